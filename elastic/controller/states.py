"""The controller's states. One small class per state, carrying the data of that state.

    WAITING ──► FORMING ──► RUNNING ──► PREPARING ──► FORMING ──► RUNNING ...
       ▲           │  ▲        │  │                    │
       └───────────┘  └────────┘  └──► FINISHING ──► FINISHED      (any) ──► FAILED

A `Formation` is one offer of a generation: its members, why, and where the old members switch.

The states are frozen, except the three that collect one answer per member (`Preparing`'s
steps, `Forming`'s acknowledgements, `Finishing`'s members still ending): those are plain
dataclasses whose dict or set the protocol fills in place, since a new state per answer would
copy O(W) each, O(W^2) per formation (`tests/test_protocol_cost.py`). Their other fields are
never reassigned.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any


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

    @functools.cached_property
    def ranks(self) -> dict[int, int]:
        """Each member's rank: whether a worker is a member, in O(1), once it was built."""
        return dict(zip(self.members, range(len(self.members))))


@dataclass(frozen=True)
class Waiting:
    since: float
    deadline: float
    reason: str
    name: str = field(default="WAITING", init=False)


@dataclass
class Preparing:
    """A grow: the running members were asked for their step; `answers` so far, by member."""

    formation: Formation
    answers: dict[int, int] = field(default_factory=dict)
    name: str = field(default="PREPARING", init=False)


@dataclass
class Forming:
    """Generation `formation.generation` was offered; `acked` members formed it and synced (their reports)."""

    formation: Formation
    acked: dict[int, Any] = field(default_factory=dict)
    name: str = field(default="FORMING", init=False)


@dataclass(frozen=True)
class Running:
    generation: int
    name: str = field(default="RUNNING", init=False)


@dataclass
class Finishing:
    """A member's train loop returned; the others are ending the same step. `ending`: the members
    not gone yet."""

    since: float
    ending: set[int] = field(default_factory=set)
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
