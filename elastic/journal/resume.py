"""What a restarted controller takes back from the run's journal.

Ray re-runs the controller's `__init__` when it restarts a dead controller. The journal (`events`)
tells that apart from a new `fit()` of the same run name, which starts its own attempt: only a
restart of the same attempt continues its generation numbers (a number is offered once), its
failure count (against `max_failures`) and its fired faults (each fires once per attempt). One
pass over the events, so replaying the journal of a long or a wide run costs what reading it does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Resumed:
    restarted: bool  # a controller of this attempt ran before: this one continues it
    generation: int  # the newest generation the attempt offered, or -1
    failures: int  # the failures it counted against max_failures
    fired: tuple[str, ...]  # the faults it injected, each fired once per attempt


def resume(events: Iterable[dict[str, Any]], attempt: str) -> Resumed:
    """What the controller of `attempt` continues from `events`, the run's journal oldest first."""
    restarted, generation, failures, fired = False, -1, 0, []
    for event in events:
        kind, mine = event["type"], event.get("attempt") == attempt
        if kind == "fault_injected" and mine:
            fired.append(event["fault"])
        restarted = restarted or (kind == "run_started" and mine)
        if restarted:  # the attempt's events: from its first run_started on
            generation = max(generation, event.get("generation", -1))
            if kind == "decision":
                failures = max(failures, event.get("failures", 0))
    return Resumed(restarted, generation, failures, tuple(fired))
