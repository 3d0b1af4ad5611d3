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
(https://github.com/NVIDIA/nccl/issues/992). A batch's groups are aborted between
`ncclGroupStart` and `ncclGroupEnd`, as torch's `_abort_process_group` does, because aborts of
several communicators could otherwise deadlock each other
(https://github.com/pytorch/pytorch/issues/119797). The thread is not a daemon, so the interpreter
waits for an abort under way at exit instead of tearing NCCL down under it; it ends once nothing
is queued.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

_log = logging.getLogger(__name__)


class Retirement:
    """A thread that aborts communicators handed to it, a batch at a time, and then lets go of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._batches: collections.deque[tuple[list[Any], list[Any]]] = collections.deque()
        self._thread: threading.Thread | None = None
        self.seconds: list[float] = []  # each batch's abort, in the order they ran

    def retire(self, communicators: Iterable[Any], held: Iterable[Any] = ()) -> None:
        """Abort `communicators` (process groups, or anything else with `abort()`) on the retirement
        thread, then let go of them and of `held`; returns at once."""
        with self._lock:
            self._batches.append((list(communicators), list(held)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastic-retire")
                self._thread.start()

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
            try:
                _abort_together(communicators)
            except Exception as exc:  # an abort that fails leaves the communicator to its destructor
                _log.warning("aborting %d stale communicators failed: %s: %s", len(communicators),
                             type(exc).__name__, exc)
            self.seconds.append(time.perf_counter() - began)
            # The last references go here, not on the train thread (see the module's docstring).
            communicators.clear()
            held.clear()


def _abort_together(communicators: list[Any]) -> None:
    starter = next(filter(None, map(_nccl_backend, communicators)), None)
    if starter is not None:
        starter._group_start()
    try:
        for communicator in communicators:
            communicator.abort()
    finally:
        if starter is not None:
            starter._group_end()


def _nccl_backend(communicator: Any) -> Any:
    """`communicator`'s NCCL backend, if it is a process group that has one."""
    if not isinstance(communicator, dist.ProcessGroup) or not dist.is_nccl_available():
        return None
    try:
        backend = communicator._get_backend(torch.device("cuda"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, dist.ProcessGroupNCCL) else None


# One per process: NCCL's communicators are the process's, and their aborts must not overlap.
retirement = Retirement()
