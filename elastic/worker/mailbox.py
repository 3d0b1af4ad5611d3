"""The hand-off between a worker's control thread (the controller's calls) and its train thread.

The controller offers generation specs at any time. A spec with a `switch_step` is a planned
switch (a grow): the members of the running generation take it at that step boundary. A spec
without one is taken at once: at the next boundary, or when the group breaks.

A planned switch is agreed in two phases, without any collective on the training path:

1. `prepare(g)` answers the step this rank is at, `a`, and promises not to start step `a + 2`
   until the controller commits or aborts g.
2. The controller commits g with `switch_step = max(a over members) + 2`, which no member can
   have started. Ranks of one generation are at most one step apart (each step's all-reduce
   holds them together), so a rank waits at the promise only when the commit takes longer
   than a step.

`abort(g)` releases that promise. Only the newest offer matters: a generation superseded
before it formed is never joined. The controller's calls run on several threads, so a `prepare(g)`
can run after g's abort or a newer offer (a member died as the grow was prepared): it answers,
and promises nothing, since nothing would release that promise.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from elastic.comm.group import GenerationSpec
from elastic.controller.signals import PREPARE_SLACK_STEPS
from elastic.errors import WorkerEvictedError


class GenerationMailbox:
    def __init__(
        self,
        on_waiting: Callable[[], None] = lambda: None,
        on_broken: Callable[[int], None] = lambda generation: None,
        on_formed: Callable[[int, dict[str, Any]], None] = lambda generation, outcome: None,
    ) -> None:
        # at_boundary takes the lock itself, once a step: the Condition's own __enter__ is Python code.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._on_waiting = on_waiting
        self._on_broken = on_broken
        self._on_formed = on_formed
        self._newest: GenerationSpec | None = None
        self._prepared: tuple[int, int] | None = None  # (generation, step answered)
        self._settled = -1  # the newest generation offered or aborted
        self._step = 0
        self._announced = False
        self._closed: str | None = None

    # --- control thread ------------------------------------------------------------------
    def offer(self, spec: GenerationSpec) -> None:
        with self._cond:
            self._settled = max(self._settled, spec.generation)
            if self._newest is None or spec.generation > self._newest.generation:
                self._newest = spec
                if self._prepared and self._prepared[0] <= spec.generation:
                    self._prepared = None
                self._cond.notify_all()

    def prepare(self, generation: int) -> int:
        """Phase one of a planned switch: the step this rank is at, and a promise (see above)."""
        with self._cond:
            if generation > self._settled:
                self._prepared = (generation, self._step)
            return self._step

    def abort(self, generation: int) -> None:
        with self._cond:
            self._settled = max(self._settled, generation)
            if self._prepared and self._prepared[0] == generation:
                self._prepared = None
            if self._newest is not None and self._newest.generation == generation:
                self._newest = None
            self._cond.notify_all()

    def close(self, reason: str) -> None:
        """Stop the train thread at its next wait (eviction, or the run ended)."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()

    # --- train thread --------------------------------------------------------------------
    def at_boundary(self, step: int, generation: int) -> GenerationSpec | None:
        """Called before step `step` of `generation`: the spec to switch to now, if any.

        Blocks only while a prepared switch is neither committed nor aborted and this rank
        would otherwise break its promise.
        """
        with self._lock:
            self._step = step
            while True:
                self._raise_if_closed()
                spec = self._newest
                if spec is not None and spec.generation > generation:
                    if spec.switch_step is None or step >= spec.switch_step:
                        return spec
                    return None
                if self._prepared is None or step < self._prepared[1] + PREPARE_SLACK_STEPS:
                    return None
                self._cond.wait()

    def wait_newer(self, generation: int) -> GenerationSpec:
        """Block until a generation newer than `generation` is offered; announce readiness once."""
        with self._cond:
            if not self._announced:
                self._announced = True
                self._on_waiting()
            while True:
                self._raise_if_closed()
                if self._newest is not None and self._newest.generation > generation:
                    return self._newest
                self._cond.wait()

    def formed(self, generation: int, outcome: dict[str, Any]) -> None:
        self._on_formed(generation, outcome)

    def report_broken(self, generation: int) -> None:
        self._on_broken(generation)

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise WorkerEvictedError(self._closed)
