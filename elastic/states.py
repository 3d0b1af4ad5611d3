"""The controller's states. One small class per state, carrying the data of that state.

    STARTING ──► RUNNING ◄──► RECONFIGURING
        │           │  ▲            │
        ▼           ▼  └── WAITING ◄┘   (below min_workers, until capacity_timeout_s)
      FAILED ◄──────┴──► FINISHED
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Starting:
    name: str = field(default="STARTING", init=False)


@dataclass(frozen=True)
class Running:
    generation: int
    name: str = field(default="RUNNING", init=False)


@dataclass(frozen=True)
class Reconfiguring:
    generation: int
    reason: str
    since: float
    name: str = field(default="RECONFIGURING", init=False)


@dataclass(frozen=True)
class Waiting:
    since: float
    deadline: float
    name: str = field(default="WAITING", init=False)


@dataclass(frozen=True)
class Finished:
    name: str = field(default="FINISHED", init=False)


@dataclass(frozen=True)
class Failed:
    error: str
    name: str = field(default="FAILED", init=False)


ControllerState = Starting | Running | Reconfiguring | Waiting | Finished | Failed
