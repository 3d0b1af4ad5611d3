"""Healing through Ray on one GPU (issue 38): ranks sharing it over NCCL, a death, a grow, a restart.

    .venv/bin/python -m benchmarks.gpu                 # these figures among the GPU ones
    .venv/bin/python -m benchmarks.gpu --cpu           # the same logic on CPUs over gloo: a check of the script

Every run trains the benchmark workload (benchmarks/workload.py) with a sleep of STEP_SLEEP_S in
each step, for steps of about 20 ms, each worker holding an equal share of the one GPU (a host of
its own to NCCL: `elastic.comm.binding.separate_ranks_sharing_a_gpu`).

- For RANKS in (2, 4): min_workers=RANKS-1, max_workers=RANKS. Rank 1 is killed inside its
  gradient all-reduce at KILL_STEP (benchmarks/protocol_run.py's `heal_and_grow`, whose
  arithmetic gives the figures): `recovery_s`, from the death to the commit of the healed
  generation, and `grow_pause_s`, the survivors' pause when Ray's replacement joins on the freed
  share (rank 0's step stamps).
- Every worker of a RANKS_RESTARTED-rank run is killed at RESTART_KILL_STEP, with a checkpoint
  every CHECKPOINT_EVERY steps: `restart_after_every_worker_s`, from the death to the commit of
  the generation restored from the checkpoint, split into the replacements' start (death to the
  last `worker_started`: process, imports, Ray) and the formation's phases from its `recovery`
  event (barrier; connect, which holds CUDA's initialization and the process group; sync, which
  holds the checkpoint's restore and NCCL's first communicator, built at the first collective).
"""

from __future__ import annotations

import tempfile
from typing import Any

import elastic
from benchmarks import elastic_run, protocol_run
from benchmarks.gpu_step import attempt, spread

STEP_SLEEP_S = 0.015
STEPS, KILL_STEP = 900, 100
RANKS = (2, 4)
RANKS_RESTARTED = 2
RESTART_STEPS, RESTART_KILL_STEP, CHECKPOINT_EVERY = 200, 100, 10
CPU_STEPS, CPU_KILL_STEP = 400, 40  # gloo's steps on a 2-core machine are slower; the grow still fits


def heal_figures(cpu: bool = False, rounds: int = 1) -> dict[str, Any]:
    """The figures above, each as min, median and max over `rounds` runs. A run that fails is recorded
    under `heal_failed` and left out of its figure; the other runs still run."""
    runs: dict[str, list[dict[str, Any]]] = {f"ranks_{ranks}": [] for ranks in RANKS}
    restarts: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for round_index in range(rounds):
        for ranks in RANKS:
            runs[f"ranks_{ranks}"].append(
                attempt(f"ranks_{ranks}.round_{round_index}", lambda: _heal_and_grow(ranks, cpu), failed))
        restarts.append(attempt(f"restart.round_{round_index}", lambda: _restart(cpu), failed))
    runs = {name: [run for run in measured if run is not None] for name, measured in runs.items()}
    restarts = [run for run in restarts if run is not None]
    shared = {name: {"recovery_s": spread([r["recovery"]["recovery_s"] for r in measured]),
                     "grow_pause_s": spread([r["grow"]["pause_from_steps_s"] for r in measured]),
                     "runs": measured}
              for name, measured in runs.items()}
    report = {"nccl_shared_gpu": shared,
              "restart_after_every_worker_s": {**(spread([r["seconds"] for r in restarts]) or {}), "runs": restarts}}
    if failed:
        report["heal_failed"] = failed
    return report


def _scaling(ranks: int, cpu: bool, min_workers: int) -> elastic.ScalingConfig:
    share = {"CPU": 1} if cpu else {"CPU": 1, "GPU": 1 / ranks}
    return elastic.ScalingConfig(min_workers=min_workers, max_workers=ranks, use_gpu=not cpu,
                                 resources_per_worker=share)


def _heal_and_grow(ranks: int, cpu: bool) -> dict[str, Any]:
    steps, kill_step = (CPU_STEPS, CPU_KILL_STEP) if cpu else (STEPS, KILL_STEP)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-heal-") as storage:
        return protocol_run.heal_and_grow(steps, kill_step, STEP_SLEEP_S, storage,
                                          scaling=_scaling(ranks, cpu, min_workers=ranks - 1))


def _restart(cpu: bool) -> dict[str, Any]:
    faults = [elastic.Fault(kind="kill", rank=rank, step=RESTART_KILL_STEP) for rank in range(RANKS_RESTARTED)]
    with tempfile.TemporaryDirectory(prefix="bench-gpu-restart-") as storage:
        result = elastic_run._fit({"report": False, "step_sleep_s": STEP_SLEEP_S}, RESTART_STEPS, faults, storage,
                                  checkpoint_every=CHECKPOINT_EVERY,
                                  failure=elastic.FailureConfig(max_failures=len(faults)),
                                  scaling=_scaling(RANKS_RESTARTED, cpu, min_workers=RANKS_RESTARTED))
    death = min(e["time"] for e in result.events_of("fault_injected"))
    restored = [e for e in result.events_of("recovery") if e["time"] > death and e["from_checkpoint"]]
    if not restored:
        raise RuntimeError(f"no restart from the checkpoint after every worker died; recoveries: "
                           f"{result.events_of('recovery')}")
    event = restored[0]
    started = [e["time"] for e in result.events_of("worker_started") if death < e["time"] <= event["time"]]
    return {
        "seconds": event["time"] - death,
        "replacements_started_s": max(started) - death if started else None,
        **{phase: event[phase] for phase in ("barrier_s", "connect_s", "sync_s")},
        "steps_lost": event["steps_lost"],
    }
