"""The hang probe: where this worker's train thread is, answered from the control thread.

The controller's hang check compares these counts across the members of one generation: a
rank that never entered a step's gradient sync, while its peers did and wait in it, is the one
that hangs. `HangProbe` counts what the train thread reached (the gradient syncs it entered, the
all-reduces it launched, the newest generation whose barrier it reached and whose groups it
connected), and reads from the train thread's stack whether it waits inside torch.distributed (or
in `elastic.comm.generation`'s waits on sends and receives and on NCCL's collectives to land).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from elastic.comm.generation import GenerationGroup, collectives_landed, landing_failure, wait_p2p

# The project's own waits on peers: on sends and receives (torch's schedules' too), and on NCCL's
# collectives to land (a CUDA event's wait, in no torch.distributed frame).
_PEER_WAITS = frozenset({wait_p2p.__code__, GenerationGroup.wait_landed.__code__, collectives_landed.__code__,
                         landing_failure.__code__})

if TYPE_CHECKING:
    from elastic.parallel.prepared import ComputeFrames
    from elastic.worker.step import Step


class HangProbe:
    """The train thread's progress counts, written by it and read from any thread. `compute_frames`
    gives the prepared model's torch.distributed frames that are compute, not a wait on peers."""

    def __init__(self, compute_frames: Callable[[], ComputeFrames]) -> None:
        self._compute_frames = compute_frames
        self.launched = 0  # gradient all-reduces launched in this generation
        self.entered_sync = 0  # steps whose gradient-syncing backward started in this generation
        self.unhooked_syncs = 0  # steps of the run whose gradients DDP all-reduced without the run's hook
        self.arrived = -1  # the newest generation whose barrier this rank reached
        self.connected = -1  # the newest generation whose groups this rank connected
        self.train_thread: int | None = None
        self.hooked = False  # DDP's all-reduce goes through the membership's hook, which counts its buckets
        self._waiting_on_checkpoint = False

    def enter_sync(self, step: Step) -> None:
        """The step's gradient-syncing backward starts: this rank's own compute is done.

        The count tells a hung rank from the peers waiting on it (they entered the sync it never
        reached), and the time is the rank's compute, free of waiting on slower peers.
        """
        self.entered_sync += 1
        if not self.hooked:
            self.unhooked_syncs += 1
        if step.compute_s is None:
            step.compute_s = time.perf_counter() - step.started

    def formed(self) -> None:
        """The hang check compares the counts across the members of one generation: count afresh."""
        self.entered_sync = self.launched = 0

    @contextmanager
    def waiting_on_checkpoint(self) -> Iterator[None]:
        """Waiting for a checkpoint's upload counts as progress."""
        self._waiting_on_checkpoint = True
        try:
            yield
        finally:
            self._waiting_on_checkpoint = False

    def reading(self, step: int) -> dict[str, Any]:
        return {"step": step, "entered_sync": self.entered_sync, "launched": self.launched,
                "arrived": self.arrived, "connected": self.connected, "checkpointing": self._waiting_on_checkpoint,
                "blocked_in": self.collective_in_progress()}

    def collective_in_progress(self) -> str:
        """Where the train thread waits inside a torch.distributed call (a fact read from its
        stack, not a guess from messages), or "" when it does not."""
        frame = sys._current_frames().get(self.train_thread)
        computing = self._compute_frames()
        called = None
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            # Some kinds' torch.distributed modules run the model's compute too: of their own frames,
            # only a wait on peers counts (DTensor's collectives show in _functional_collectives' frames).
            waits = not module.startswith(computing.modules) or frame.f_code.co_name in computing.waits
            if module.startswith("torch.distributed") and waits or frame.f_code in _PEER_WAITS:
                called = called or frame.f_code.co_name
            elif called is not None:
                code = frame.f_code
                return f"{called} called from {code.co_name} at {os.path.basename(code.co_filename)}:{frame.f_lineno}"
            frame = frame.f_back
        return ""
