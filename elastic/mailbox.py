"""The hand-off between a worker's control thread (the controller's calls) and its train thread.

The controller offers generation specs at any time; the train thread takes the newest one at
a step boundary or after its group broke, and posts the outcome of forming it. Only the
newest offer matters: a generation superseded before it formed is never joined.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from elastic.errors import WorkerEvictedError
from elastic.group import GenerationSpec


class GenerationMailbox:
    def __init__(self, on_broken: Callable[[int], None]) -> None:
        self._cond = threading.Condition()
        self._on_broken = on_broken
        self._newest: GenerationSpec | None = None
        self._formed: dict[int, dict[str, Any]] = {}
        self._waiting = False
        self._closed: str | None = None
        # Read without the lock at every step boundary; a stale value only delays a switch by one step.
        self.newest_generation = -1

    # --- control thread ------------------------------------------------------------------
    def offer(self, spec: GenerationSpec) -> None:
        with self._cond:
            if self._newest is None or spec.generation > self._newest.generation:
                self._newest = spec
                self.newest_generation = spec.generation
                self._cond.notify_all()

    def close(self, reason: str) -> None:
        """Stop the train thread at its next wait (eviction, or the run ended)."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()

    def wait_waiting(self, timeout_s: float) -> bool:
        """Block until the train thread waits for a generation (it is ready to join one)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting or self._closed is not None, timeout_s) and self._waiting

    def wait_formed(self, generation: int, timeout_s: float) -> dict[str, Any]:
        def done() -> bool:
            superseded = self._newest is not None and self._newest.generation > generation
            return generation in self._formed or superseded or self._closed is not None

        with self._cond:
            if not self._cond.wait_for(done, timeout_s):
                return {"ok": False, "error": f"generation {generation} did not form within {timeout_s} s"}
            if generation in self._formed:
                return self._formed[generation]
            return {"ok": False, "error": f"generation {generation} was superseded or the worker stopped"}

    # --- train thread --------------------------------------------------------------------
    def wait_newer(self, generation: int) -> GenerationSpec:
        with self._cond:
            self._waiting = True
            self._cond.notify_all()
            try:
                self._cond.wait_for(
                    lambda: self._closed is not None
                    or (self._newest is not None and self._newest.generation > generation)
                )
            finally:
                self._waiting = False
            if self._closed is not None:
                raise WorkerEvictedError(self._closed)
            return self._newest

    def formed(self, generation: int, outcome: dict[str, Any]) -> None:
        with self._cond:
            self._formed[generation] = outcome
            self._cond.notify_all()

    def report_broken(self, generation: int) -> None:
        self._on_broken(generation)
