"""How a step ends: committed when the prepared optimizer steps, or rolled back to be redone.

A step commits when the optimizer's `step()` returns (its post hook): the run's step count
grows and the data cursor moves only then. When the `with step:` block ends, `Stepping.end`
reports the step's timings, or, if a peer's failure ended it, keeps the failure's message and
rolls back what the half-done step changed (its gradients, the techniques' per-step state, the
random streams), so that the step is redone in the healed generation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from elastic.comm.generation import landing_failure, peer_failed
from elastic.techniques.strategy import Techniques
from elastic.worker.batching import MicroBatching
from elastic.worker.injection import FaultInjector
from elastic.worker.membership import Progress
from elastic.worker.phases import phase
from elastic.worker.random_state import RandomState
from elastic.worker.step import Step

_log = logging.getLogger(__name__)


class Stepping:
    """The step being run, and what commits or rolls it back: the `StepEnd` every `Step` calls."""

    def __init__(self, progress: Progress, batching: MicroBatching, techniques: Techniques, random: RandomState,
                 faults: FaultInjector, report_sink: Callable[[dict[str, Any]], None],
                 warn: Callable[[str, str], None] = lambda kind, message: None) -> None:
        self._progress = progress
        self._batching = batching
        self._techniques = techniques
        self._random = random
        self._faults = faults
        self._report_sink = report_sink
        self._warn = warn  # once per kind: the journal and the driver
        self.current: Step | None = None  # the step the train loop holds
        self.inside_step = False  # between its __enter__ and __exit__
        self.optimizer: torch.optim.Optimizer | None = None
        self.model: torch.nn.Module | None = None  # the prepared model, where the loop calls it
        self.compute_s = 0.0  # the last step's own compute, for the faults that slow a rank

    def commit(self) -> None:
        step = self.current
        if step is None or step.committed or step.failed is not None:
            return  # (a failed step is rolled back and redone: Ray Train's loop shape steps it anyway)
        step.committed = True
        self._techniques.committed()
        self._progress.step += 1
        self._progress.cursor = self._batching.loader.advance(self._progress.cursor)

    def end(self, step: Step, exc: BaseException | None) -> bool:
        """The `with step:` block ended; True to swallow `exc`, a peer's failure the next join heals."""
        if exc is None and not step.committed and step.failed is None and not self._techniques.lands_own_sums:
            # No optimizer stepped, whose step waits for the step's collectives to land: they land
            # here, so that every rank waits once a step (on NCCL the wait is a collective).
            exc = landing_failure()
        if exc is None:
            if not step.committed and not step.optimizer_called:
                self._warn("step_without_optimizer", (
                    f"step {step.index} ended on rank {step.rank} without a call to the prepared optimizer's step(): "
                    "it commits, its samples count as trained, and nothing of it was applied. A batch skipped on "
                    "purpose is fine; a loop that never steps the optimizer, or steps one that was not prepared "
                    "(elastic.prepare_optimizer), trains nothing that counts"))
            with phase("elastic.commit"):
                self.commit()
                if step.compute_s is not None:
                    self.compute_s = step.compute_s - self._faults.slow_extra_s
                self._report_sink({"kind": "step", "step": step.index, "rank": step.rank,
                                   "world_size": step.world_size, "generation": step.generation,
                                   "step_s": time.perf_counter() - step.started, "compute_s": step.compute_s,
                                   "samples": step.samples, "time": time.time()})
            return False
        if peer_failed(exc):
            # Keep the message, not the exception: its traceback would keep the old DDP alive.
            step.failed = f"{type(exc).__name__}: {exc}"
            _log.warning("step %d failed on a peer's failure (%s); %s", step.index, step.failed,
                         "it committed here" if step.committed else "rolled back, to be redone after the heal")
            if not step.committed:
                # The techniques first: the overlapped optimizer may still be stepping on the gradients.
                self._techniques.failed()
                # The model's own too: a step that failed before the optimizer was prepared (at its
                # first step()) left them there, and the redo would add to them.
                for holder in (self.optimizer, self.model):
                    if holder is not None:
                        holder.zero_grad(set_to_none=True)
                self._random.rewind()
            return True
        return False
