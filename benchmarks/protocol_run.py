"""The healing protocol's own costs: recovery from a death, the pause of a grow, and the time back to full size.

    .venv/bin/python -m benchmarks.bench --only protocol          # 3 rounds, about 5 minutes
    .venv/bin/python -m benchmarks.bench --only protocol --quick  # 1 round, under 2 minutes

Every run trains the benchmark workload (benchmarks/workload.py) with min_workers=1 and
max_workers=2, and kills rank 1 with `Fault(kind="kill", rank=1, step=N, where="allreduce")`.
The kill lands inside the gradient all-reduce, after the rank's compute, when its peer is
(or is about to be) blocked in the same all-reduce: detection then measures the protocol, not
the survivor's remaining compute. A kill at the start of a step would add up to one step of
the survivor's compute before it noticed, which at 1 s steps would swamp everything else.

Two step times: the workload as it is (~15 ms steps), and the same with a sleep of
`SLOW_STEP_SLEEP_S` inside each step, before the backward, standing for a model whose step
takes ~1 s. One run at each step time yields three figures, because the run heals to 1
worker and then grows back to 2 when the replacement that the controller requests is ready
(~4 s later):

- recovery: from the death to the commit of the healed generation. The death is the time of
  the `fault_injected` event, which the dying rank has the controller record just before it
  exits (so the death itself comes a few ms later, and `detect_s` is that much too long).
  Its breakdown comes from the controller's `recovery` event:
  `detect_s` = (event time - `seconds`) - death, the time until the controller saw the first
  sign; `decide_s`, from that sign to the offer; `rendezvous_s` = `barrier_s` + `connect_s`
  and `sync_s`, the largest over the members of each phase of joining; `other_s`, the rest
  (the offer's and the members' reports' trips).
- grow pause: the survivor's pause when the replacement joins, from rank 0's step stamps: the
  gap before the switch step's completion less the median gap of the grown generation's later
  steps. Beside it, `pause_s` of the grow's `generation_formed` event: the most over the
  running members (not the newcomer, whose wait at the barrier stops nobody) of leave +
  barrier + connect + sync.
- back to full size without a spare: from the death to the commit of the grow back to
  max_workers, split into the replacement's start (death to its `worker_started`) and the
  grow itself.

A third run keeps one warm spare (`ScalingConfig(spare_workers=1)`) at fast steps; the heal
takes the spare, so the run is back at max_workers at the heal's commit. Its Ray instance gets
a logical CPU for the idle spare (benchmarks/bench.py), which a 2-core machine lacks.
"""

from __future__ import annotations

import statistics
from typing import Any

import elastic
from benchmarks import elastic_run, workload

SLOW_STEP_SLEEP_S = 1.0
KILLED_RANK = 1


def heal_and_grow(steps: int, kill_step: int, step_sleep_s: float, storage: str,
                  scaling: elastic.ScalingConfig | None = None) -> dict[str, Any]:
    """Kill rank 1 mid all-reduce at `kill_step`; the recovery, then the grow back to max_workers
    (workload.WORLD_SIZE, unless `scaling` says otherwise: benchmarks/gpu_heal.py's ranks sharing a GPU)."""
    fault = elastic.Fault(kind="kill", rank=KILLED_RANK, step=kill_step, where="allreduce")
    config = {"report": False, "step_sleep_s": step_sleep_s, "stamp_failures": True}
    result = elastic_run._fit(config, steps, [fault], storage, scaling=scaling)
    full_size = scaling.max_workers if scaling is not None else workload.WORLD_SIZE
    death = _death_time(result)
    stamps = [s for s in result.value if not s.get("failed")]
    grows = [e for e in result.events_of("generation_formed")
             if e["kind"] == "grow" and e["time"] > death and e["world_size"] == full_size]
    if not grows:
        raise RuntimeError(f"no grow back to {full_size} workers before step {steps}, the last; raise "
                           f"the run's steps. Generations formed: {_formations(result)}")
    grow = grows[0]
    ready = next((e for e in result.events_of("worker_started") if death < e["time"] <= grow["time"]), None)
    before = [s for s in stamps if s["step"] < kill_step]
    return {
        "step_s": _median_gap(before),
        "recovery": _recovery(result, death),
        "survivor_saw_failure_s": _saw_failure(result, death),
        "grow": {
            "pause_s": grow["pause_s"],
            "pause_from_steps_s": _pause_from_steps(stamps, grow),
            **{k: grow[k] for k in ("barrier_s", "connect_s", "sync_s", "switch_step", "step", "generation")},
        },
        "full_size": {
            "seconds": grow["time"] - death,
            "replacement_start_s": ready["time"] - death if ready else None,
            "grow_s": grow["time"] - ready["time"] if ready else None,
        },
        "formations": _formations(result),
    }


def spare(steps: int, kill_step: int, storage: str) -> dict[str, Any]:
    """With one warm spare, kill rank 1 mid all-reduce; the heal takes the spare and stays at max_workers."""
    fault = elastic.Fault(kind="kill", rank=KILLED_RANK, step=kill_step, where="allreduce")
    result = elastic_run._fit({"report": False, "stamp_failures": True}, steps, [fault], storage, spare_workers=1)
    death = _death_time(result)
    recovery = _recovery(result, death)
    if recovery["world_size"] != workload.WORLD_SIZE:
        raise RuntimeError(f"the heal formed {recovery['world_size']} workers, not {workload.WORLD_SIZE}: the spare "
                           f"was not ready by step {kill_step}; kill later. Generations: {_formations(result)}")
    return {
        "step_s": _median_gap([s for s in result.value if s["step"] < kill_step and not s.get("failed")]),
        "recovery": recovery,
        "survivor_saw_failure_s": _saw_failure(result, death),
        "full_size": {"seconds": recovery["recovery_s"]},
        "formations": _formations(result),
    }


def _death_time(result: elastic.Result) -> float:
    injected = result.events_of("fault_injected")
    if not injected:
        raise RuntimeError(f"the fault never fired; events: {[e['type'] for e in result.events]}")
    return injected[0]["time"]


def _recovery(result: elastic.Result, death: float) -> dict[str, Any]:
    """The heal after `death`, split into its phases (see the module docstring)."""
    events = [e for e in result.events_of("recovery") if e["time"] > death]
    if not events:
        raise RuntimeError(f"no recovery event after the kill; events: {[e['type'] for e in result.events]}")
    event = events[0]
    total = event["time"] - death
    parts = {
        "detect_s": event["time"] - event["seconds"] - death,
        "decide_s": event["decide_s"],
        "rendezvous_s": event["barrier_s"] + event["connect_s"],
        "sync_s": event["sync_s"],
    }
    return {
        "recovery_s": total,
        **parts,
        "other_s": total - sum(parts.values()),
        "controller_s": event["seconds"],
        "leave_s": event.get("leave_s"),  # the survivor's own leaving, alongside detect and decide
        "barrier_s": event["barrier_s"],
        "connect_s": event["connect_s"],
        "steps_lost": event["steps_lost"],
        "from_checkpoint": event["from_checkpoint"],
        "world_size": event["world_size"],
    }


def _saw_failure(result: elastic.Result, death: float) -> float | None:
    """From the death to rank 0's train loop seeing its step fail (the loop stamps it)."""
    failed = [s for s in result.value if s.get("failed")]
    return failed[0]["time"] - death if failed else None


def _pause_from_steps(stamps: list[dict[str, Any]], grow: dict[str, Any]) -> float | None:
    """The switch step's gap on rank 0 less the median gap of the grown generation's later steps."""
    index = next((i for i, s in enumerate(stamps) if s["generation"] == grow["generation"]), None)
    if not index:
        return None
    after = [s for s in stamps[index:] if s["generation"] == grow["generation"]]
    if len(after) < 4:
        return None
    return stamps[index]["time"] - stamps[index - 1]["time"] - _median_gap(after)


def _median_gap(stamps: list[dict[str, Any]]) -> float | None:
    gaps = [b["time"] - a["time"] for a, b in zip(stamps, stamps[1:]) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else None


def _formations(result: elastic.Result) -> list[dict[str, Any]]:
    return [{k: e.get(k) for k in ("generation", "kind", "world_size", "step", "switch_step", "pause_s", "seconds")}
            for e in result.events_of("generation_formed")]
