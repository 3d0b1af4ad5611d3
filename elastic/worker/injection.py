"""Fault injection at named points of a worker's life, kept off the training path.

The train context calls `FaultInjector.at(point, rank, step)` at a few named points:

| point | where |
|---|---|
| `step_start` | before a step's forward |
| `allreduce` | inside the gradient all-reduce: DDP's, on its own path, once the backward's last gradient accumulated (`Generation.inside_all_reduce`); a replica kind's average |
| `barrier` | as the rank reaches the barrier of a generation it joins |
| `connect` | past the barrier's "go" of a generation it joins, before its connect: its peers wait for its address |
| `prepare` | as the rank answers a grow's prepare (on the worker's control thread) |

A fault fires once per `fit()`: the first rank to meet it claims it through the run's store
(`claim`), which also tells the controller. Faults of other points never slow these calls:
`at` returns at once when no fault is due there, and a run without faults (`armed` False) does
not call the points of every step.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

from elastic.faults import Fault, InjectedError

# Faults acted on at each point; the other kinds are handled where they act (checkpoint
# writes, the controller) or by the worker before it dies (node-loss, controller-kill).
_KINDS_AT = {
    "step_start": ("kill", "node-loss", "raise", "slow", "controller-kill"),
    "allreduce": ("kill", "hang"),
    "barrier": ("kill",),
    "connect": ("kill",),
    "prepare": ("kill",),
    "checkpoint": ("kill",),
}


class FaultInjector:
    def __init__(self, faults: list[Fault], claim: Callable[[Fault], bool]) -> None:
        self.faults = faults
        self.armed = bool(faults)  # False: the per-step points (step_start, allreduce) are not called at all
        self._claim = claim
        self.slow_extra_s = 0.0  # added to each step by a `slow` fault, from its firing on

    def at(self, point: str, rank: int, step: int, compute_s: float = 0.0) -> None:
        if not self.faults:
            return  # a run without injected faults, at every step's start
        for fault in self._due(point, rank, step):
            if fault.kind in ("kill", "node-loss"):
                die()  # for node-loss, the worker's claim handler has already taken the node down
            elif fault.kind == "raise":
                raise InjectedError(f"injected application error on rank {rank} at step {step}")
            elif fault.kind == "slow":
                self.slow_extra_s = (fault.factor - 1) * compute_s
            elif fault.kind == "hang":
                threading.Event().wait()  # never set: this rank never contributes to the all-reduce
            # controller-kill: the claim handler has already told the controller to die

    def crash_checkpoint(self, rank: int, step: int) -> bool:
        """Whether this rank's shard write of `step` dies halfway."""
        return any(self._claim(f) for f in self.faults
                   if f.kind == "checkpoint-crash" and f.rank == rank and f.step == step)

    def _due(self, point: str, rank: int, step: int) -> list[Fault]:
        kinds = _KINDS_AT[point]
        return [
            f for f in self.faults
            if f.kind in kinds and f.point == point and f.rank == rank
            and (step >= f.step if f.at_or_after else step == f.step) and self._claim(f)
        ]


def die() -> None:
    """Injected process death: no cleanup, no exit handlers, exactly like a crash."""
    os._exit(1)
