"""Aborting a generation's NCCL communicators off the heal's path.

`ncclCommAbort` first raises the communicator's abort flag, which its kernels poll, so a survivor
blocked in a kernel on a dead peer is freed at once. Then it joins NCCL's proxy service thread and
its UDS thread, each of which waits on a poll with a literal 500 ms timeout that nothing wakes on
an abort (NCCL's src/proxy.cc, 2.21 to 2.30): about a second per abort on an H200
(`benchmarks/gpu.py`'s `nccl_generations`), twenty times the heal this project promises. So a
process's communicators are aborted here, on a thread of their own, while the train thread forms
and trains the next generation:

- the control thread's abort of a stale generation (`GenerationGroup.abort`) hands its world group
  here and returns;
- a worker leaving an NCCL generation (`elastic.comm.group.leave_group`) takes every group out of
  torch's registry and hands them here, with its last references to what holds them. They are
  aborted, then let go of on this thread, so their destructors (which join torch's watchdog
  threads) run here too.

Batches are aborted one after another, never two at once: concurrent aborts hung before NCCL 2.19
(https://github.com/NVIDIA/nccl/issues/992). torch's `ProcessGroupNCCL::abort` itself aborts a
group's communicators together, between `ncclGroupStart` and `ncclGroupEnd` (NCCL 2.22 and later),
on a thread of its own. The control thread's batch, which is what frees a kernel waiting on a dead
peer, goes before any batch still queued; one already under way is finished first (about a second:
a second death within a second of a heal waits that long). The thread is not a daemon, so the
interpreter waits for an abort under way at exit instead of tearing NCCL down under it; it ends
once nothing is queued.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

_log = logging.getLogger(__name__)


class Retirement:
    """A thread that aborts communicators handed to it, a batch at a time, and then lets go of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._batches: collections.deque[tuple[list[Any], list[Any]]] = collections.deque()
        self._thread: threading.Thread | None = None
        self.seconds: list[float] = []  # each batch's abort, in the order they ran

    def retire(self, communicators: Iterable[Any], held: Iterable[Any] = (), urgent: bool = False) -> None:
        """Abort `communicators` (process groups, or anything else with `abort()`) on the retirement
        thread, then let go of them and of `held`; returns at once. `urgent`: before the batches
        still queued (the control thread's abort, which frees kernels waiting on a dead peer)."""
        batch = (list(communicators), list(held))
        with self._lock:
            if urgent:
                self._batches.appendleft(batch)
            else:
                self._batches.append(batch)
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="elastic-retire")
                thread.start()
                self._thread = thread

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every batch handed over so far was aborted; False if `timeout_s` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._thread is None, timeout_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._batches:
                    self._thread = None
                    self._idle.notify_all()
                    return
                communicators, held = self._batches.popleft()
            began = time.perf_counter()
            for communicator in communicators:
                try:
                    communicator.abort()
                except Exception as exc:  # the others are still aborted; this one is left to its destructor
                    _log.warning("aborting a stale communicator failed: %s: %s", type(exc).__name__, exc)
            self.seconds.append(time.perf_counter() - began)
            # The last references go here, not on the train thread (see the module's docstring).
            communicators.clear()
            held.clear()


# One per process: NCCL's communicators are the process's, and their aborts must not overlap.
retirement = Retirement()
