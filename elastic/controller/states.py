"""The controller's states. One small frozen class per state, carrying the data of that state.

    WAITING ──► FORMING ──► RUNNING ──► PREPARING ──► FORMING ──► RUNNING ...
       ▲           │  ▲        │  │                    │
       └───────────┘  └────────┘  └──► FINISHING ──► FINISHED      (any) ──► FAILED

A `Formation` is one offer of a generation: its members, why, and where the old members switch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Reason(enum.Enum):
    START = "start"  # the first generation of this attempt
    HEAL = "heal"  # the running generation lost a member
    GROW = "grow"  # ready workers join a healthy generation at a step boundary
    RESTART = "restart"  # no member holds live state: restore the latest checkpoint


@dataclass(frozen=True)
class Formation:
    generation: int
    members: tuple[int, ...]
    reason: Reason
    detail: str  # the decision's reason, for people
    since: float  # when the need for it arose (for a heal: the first sign of the failure)
    switch_step: int | None = None  # a grow's agreed boundary; None: join at once
    decided_at: float = 0.0


@dataclass(frozen=True)
class Waiting:
    since: float
    deadline: float
    reason: str
    name: str = field(default="WAITING", init=False)


@dataclass(frozen=True)
class Preparing:
    """A grow: the running members were asked for their step; `answers` so far."""

    formation: Formation
    answers: tuple[tuple[int, int], ...] = ()
    name: str = field(default="PREPARING", init=False)


@dataclass(frozen=True)
class Forming:
    """Generation `formation.generation` was offered; `acked` members formed it and synced."""

    formation: Formation
    acked: tuple[tuple[int, dict], ...] = ()
    name: str = field(default="FORMING", init=False)


@dataclass(frozen=True)
class Running:
    generation: int
    name: str = field(default="RUNNING", init=False)


@dataclass(frozen=True)
class Finishing:
    """A member's train loop returned; the others are ending the same step."""

    since: float
    name: str = field(default="FINISHING", init=False)


@dataclass(frozen=True)
class Finished:
    name: str = field(default="FINISHED", init=False)


@dataclass(frozen=True)
class Failed:
    error: str
    kind: str = "error"  # "app_error", "capacity", "formation", "crash_loop", "all_lost", "state_lost"
    rank: int | None = None
    traceback: str = ""
    name: str = field(default="FAILED", init=False)


ControllerState = Waiting | Preparing | Forming | Running | Finishing | Finished | Failed
TERMINAL = (Finished, Failed)
