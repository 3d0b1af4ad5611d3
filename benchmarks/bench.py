"""Plain torch DDP, Ray Train and elastic side by side on one fixed workload, in one command.

    .venv/bin/python -m benchmarks.bench                   # full run, about 12 minutes
    .venv/bin/python -m benchmarks.bench --quick           # fewer steps, one round, about 4 minutes
    .venv/bin/python -m benchmarks.bench --only protocol   # the healing protocol's figures alone, about 5 minutes
    .venv/bin/python -m benchmarks.bench --out /tmp/bench.json

Run it from the repository root. The workload (benchmarks/workload.py) is an MLP
256-1024-1024-10 trained with SGD by 2 CPU workers over gloo, 64 samples per worker per step,
one torch thread per worker process. Measured:

- median step time without reporting, for all three systems, and with a metrics report every
  step for Ray Train (`ray.train.report`) and elastic (`elastic.report`);
- recovery: rank 1 dies at the start of a step; the time from its death to the next completed
  step, and how many steps were lost;
- the healing protocol (benchmarks/protocol_run.py): rank 1 dies mid all-reduce at 15 ms and at
  1 s steps; the recovery from death to the healed generation's commit with its breakdown, the
  survivor's pause when the replacement joins, and the time back to max_workers with and
  without a warm spare, each as min, median and max over the rounds.

Each system runs in its own subprocess (and Ray session) per round, so a hang or a crash in
one cannot skew the next. The systems take turns for `--rounds` rounds and each figure is
the median of its round medians, so a burst of load on the machine hits every system alike.
The recovery runs, and Ray Train's reporting run (each of its steps lasts one poll of its
controller, ~2 s, so a repeat costs minutes and tells nothing new), happen in the first round;
the protocol runs happen in every round. The JSON lands in benchmarks/results/bench.json
unless --out says otherwise; a short table is printed. `--only protocol` merges its keys into
the JSON already at --out and keeps the others; `produced_by` records which command wrote
which keys, and when.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import ray
import torch
from ray.train.v2._internal.constants import (
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    is_v2_enabled,
)

from benchmarks import elastic_run, protocol_run, ray_train, torch_ddp, workload

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results", "bench.json")
SYSTEMS = ("torch_ddp", "ray_train", "elastic")
# The healing protocol's runs, each in a subprocess of its own (benchmarks/protocol_run.py).
PROTOCOL_SYSTEMS = ("protocol_fast", "protocol_slow", "protocol_spare")
ONLY = {"protocol": PROTOCOL_SYSTEMS}
STEADY_RUNS = ("torch_ddp", "ray_train", "ray_train_report", "elastic", "elastic_report")
LOG_TAIL_LINES = 40


@dataclasses.dataclass(frozen=True)
class Plan:
    steps: int
    """Steps of each steady run, reporting or not; Ray Train's reporting run excepted."""
    ray_report_steps: int
    """Steps of Ray Train's reporting run: each reporting step waits for a poll (~2 s), so fewer."""
    rounds: int
    """Turns each system takes; the steady figures are medians over the rounds."""
    recovery_steps: int
    """Steps of each recovery run; a few past the kill suffice."""
    kill_step: int
    """Step at whose start rank 1 dies, in both recovery runs."""
    ray_checkpoint_every: int
    """Steps between Ray Train's checkpoints in its recovery run."""
    timeout_s: float
    """Limit on one system's subprocess in one round."""
    checkpoint_steps: int
    """Steps of elastic's checkpoint run (a checkpoint every 10)."""
    chaos_steps: int
    """Steps of elastic's chaos run."""
    chaos_every_steps: int
    """Steps between the chaos run's kills (about 10 s of steps here)."""
    protocol_fast_steps: int
    """Steps of the protocol run at ~15 ms steps: after the kill, enough for the replacement to start and join."""
    protocol_fast_kill_step: int
    """Step in whose all-reduce rank 1 dies, in the fast protocol run."""
    protocol_slow_steps: int
    """Steps of the protocol run at ~1 s steps (a sleep of protocol_run.SLOW_STEP_SLEEP_S in each)."""
    protocol_slow_kill_step: int
    """Step in whose all-reduce rank 1 dies, in the slow protocol run."""
    protocol_spare_steps: int
    """Steps of the fast protocol run with one warm spare."""
    protocol_spare_kill_step: int
    """Step in whose all-reduce rank 1 dies with a spare: late enough for the spare to be ready."""


# The protocol runs are as long in both presets: a shorter one would end before the replacement
# (~4 s to start) grows the run back. The fast run leaves ~800 steps (~13 s) after the kill, the
# slow one 20 (~20 s); with a spare, the kill waits ~4 s for the spare to be ready.
_PROTOCOL_STEPS = dict(protocol_fast_steps=900, protocol_fast_kill_step=100, protocol_slow_steps=28,
                       protocol_slow_kill_step=8, protocol_spare_steps=400, protocol_spare_kill_step=300)
# Ray Train checkpoints every 10 steps: each checkpoint is a report, and reports wait for the
# controller's poll, so checkpointing every step would make every step last ~2 s. The kill
# lands mid-way between two checkpoints, where a crash falls on average.
FULL = Plan(steps=400, ray_report_steps=50, rounds=3, recovery_steps=80, kill_step=65, ray_checkpoint_every=10,
            timeout_s=600.0, checkpoint_steps=100, chaos_steps=4200, chaos_every_steps=600, **_PROTOCOL_STEPS)
QUICK = Plan(steps=80, ray_report_steps=26, rounds=1, recovery_steps=30, kill_step=25, ray_checkpoint_every=10,
             timeout_s=360.0, checkpoint_steps=50, chaos_steps=1300, chaos_every_steps=600, **_PROTOCOL_STEPS)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.measure:
        _measure_in_this_process(args.measure, json.loads(args.params), args.result)
        return 0
    plan = QUICK if args.quick else FULL
    if args.steps is not None:
        plan = dataclasses.replace(plan, steps=args.steps)
    if args.rounds is not None:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    systems = ONLY[args.only] if args.only else SYSTEMS + PROTOCOL_SYSTEMS
    log_dir = tempfile.mkdtemp(prefix="bench-logs-")
    started = time.time()
    errors: dict[str, str] = {}
    protocol_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PROTOCOL_SYSTEMS}
    rounds: dict[str, list[float]] = {name: [] for name in STEADY_RUNS}
    counts: dict[str, list[int]] = {name: [] for name in STEADY_RUNS}
    recoveries: dict[str, dict[str, Any]] = {}
    extras: dict[str, dict[str, Any]] = {}
    walls: dict[str, dict[str, float]] = {}
    for round_index in range(plan.rounds):
        for system in systems:
            label = f"{system}-round{round_index}"
            params = {**plan.__dict__, "first_round": round_index == 0}
            outcome = _measure_in_subprocess(label, system, params, plan.timeout_s, log_dir)
            if "error" in outcome:
                errors[label] = outcome["error"]
                continue
            for run in ("steady", "report"):
                if run not in outcome:
                    continue
                name = system if run == "steady" else f"{system}_report"
                gaps = workload.steady_gaps(outcome[run])
                if not gaps:
                    errors[f"{label}-{run}"] = (f"no steady steps among {len(outcome[run])} at world size "
                                                f"{workload.WORLD_SIZE} past the warm-up; run more steps")
                    continue
                rounds[name].append(statistics.median(gaps))
                counts[name].append(len(gaps))
            if "recovery" in outcome:
                recoveries[system] = outcome["recovery"]
            if "protocol" in outcome:
                protocol_runs[system].append(outcome["protocol"])
            for extra in ("checkpoint", "hang", "chaos"):
                if extra in outcome:
                    extras[extra] = outcome[extra]
            if "wall_s" in outcome:
                walls[label] = outcome["wall_s"]
    protocol_errors = {label: why for label, why in errors.items() if label.startswith(PROTOCOL_SYSTEMS)}
    protocol_walls = {label: wall for label, wall in walls.items() if label.startswith(PROTOCOL_SYSTEMS)}
    protocol = _summarise_protocol(args, plan, protocol_runs, protocol_errors, protocol_walls)
    provenance = _provenance(time.time() - started)
    if args.only:
        report = _merge(_read_report(args.out), protocol, provenance)
    else:
        report = _summarise(args, plan, rounds, counts, recoveries, extras, errors, walls, time.time() - started)
        report.update(protocol)
        report["definitions"].update(PROTOCOL_DEFINITIONS)
        report["produced_by"] = [{**provenance, "keys": sorted(report)}]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    _print_table(report)
    print(f"\nwrote {args.out}")
    if errors:
        print(f"{len(errors)} measurement(s) failed: {', '.join(errors)}; logs in {log_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and one round; about 4 minutes, under 2 with --only protocol")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where to write the JSON (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="steps of each steady run (overrides the preset)")
    parser.add_argument("--rounds", type=int, help="round-robin rounds of the steady and protocol runs "
                                                   "(overrides the preset)")
    parser.add_argument("--only", choices=sorted(ONLY),
                        help="run only these measurements and merge their keys into the JSON at --out")
    # Internal: the parent re-runs this module with these to make one measurement in a fresh process.
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps <= workload.WARMUP_STEPS + 1:
        parser.error(f"--steps({args.steps}) must exceed the warm-up of {workload.WARMUP_STEPS} steps by at least 2")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds({args.rounds}) must be at least 1")
    return args


def _measure_in_subprocess(label: str, name: str, params: dict[str, Any], timeout_s: float,
                           log_dir: str) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; its result, or {"error": ...} if it failed."""
    result_path = os.path.join(log_dir, f"{label}.json")
    log_path = os.path.join(log_dir, f"{label}.log")
    env = dict(os.environ)
    # Ray's worker processes inherit the environment, so they can import `benchmarks` too.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    command = [sys.executable, "-m", "benchmarks.bench", "--measure", name, "--params", json.dumps(params),
               "--result", result_path]
    print(f"[bench] {label} ...", end="", flush=True)
    began = time.time()
    with open(log_path, "w") as log:
        # A session of its own, so that a timeout also ends the Ray processes the child started.
        child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(child.pid)
            child.wait()
            code = None
    took = time.time() - began
    if code == 0 and os.path.exists(result_path):
        print(f" {took:.0f} s", flush=True)
        with open(result_path) as f:
            return json.load(f)
    why = f"timed out after {timeout_s:.0f} s" if code is None else f"exited with code {code}"
    with open(log_path) as f:
        tail = "".join(f.readlines()[-LOG_TAIL_LINES:])
    print(f" FAILED ({why}); last lines of {log_path}:\n{tail}", flush=True)
    return {"error": f"{why}; log: {log_path}"}


def _kill_session(session_id: int) -> None:
    """SIGKILL every process of a session this script started; Ray workers sit in process groups of their own."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # Fields after the parenthesised command name: state, ppid, pgrp, session, ...
                session = int(f.read().rsplit(")", 1)[1].split()[3])
            if session == session_id:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


def _measure_in_this_process(system: str, params: dict[str, Any], result_path: str) -> None:
    torch.set_num_threads(1)
    if system == "torch_ddp":
        result = {"steady": torch_ddp.steady(params["steps"])}
    else:
        result = _measure_on_ray(system, params)
    with open(result_path, "w") as f:
        json.dump(result, f)


def _measure_on_ray(system: str, params: dict[str, Any]) -> dict[str, Any]:
    """One system's runs of one round, in one Ray session; some only in the first round."""
    if system == "ray_train":
        runs = {
            "steady": lambda: ray_train.steady(params["steps"], report=False, storage=storage),
            "report": lambda: ray_train.steady(params["ray_report_steps"], report=True, storage=storage),
            "recovery": lambda: ray_train.recovery(params["recovery_steps"], params["kill_step"],
                                                   params["ray_checkpoint_every"], storage),
        }
        once = ("report", "recovery")
    elif system == "elastic":
        runs = {
            "steady": lambda: elastic_run.steady(params["steps"], report=False, storage=storage),
            "report": lambda: elastic_run.steady(params["steps"], report=True, storage=storage),
            "recovery": lambda: elastic_run.recovery(params["recovery_steps"], params["kill_step"], storage),
            "checkpoint": lambda: elastic_run.checkpoint(params["checkpoint_steps"], 10, storage),
            "hang": lambda: elastic_run.hang(params["recovery_steps"], params["kill_step"], storage),
            "chaos": lambda: elastic_run.chaos(params["chaos_steps"], params["chaos_every_steps"], storage),
        }
        once = ("recovery", "checkpoint", "hang", "chaos")
    elif system == "protocol_fast":
        runs = {"protocol": lambda: protocol_run.heal_and_grow(
            params["protocol_fast_steps"], params["protocol_fast_kill_step"], 0.0, storage)}
        once = ()
    elif system == "protocol_slow":
        runs = {"protocol": lambda: protocol_run.heal_and_grow(
            params["protocol_slow_steps"], params["protocol_slow_kill_step"], protocol_run.SLOW_STEP_SLEEP_S, storage)}
        once = ()
    elif system == "protocol_spare":
        runs = {"protocol": lambda: protocol_run.spare(
            params["protocol_spare_steps"], params["protocol_spare_kill_step"], storage)}
        once = ()
    else:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS + PROTOCOL_SYSTEMS)}")
    if not params["first_round"]:
        runs = {name: run for name, run in runs.items() if name not in once}
    storage = tempfile.mkdtemp(prefix=f"bench-{system}-")
    began = time.time()
    # Each worker asks Ray for one CPU; the idle spare needs one more than the two training
    # workers, which a 2-core machine would otherwise not schedule until a worker died.
    num_cpus = max(os.cpu_count() or 1, workload.WORLD_SIZE + 1) if system == "protocol_spare" else None
    # "local" starts a fresh instance even when a cluster from `ray start` runs on this machine.
    ray.init(address="local", num_cpus=num_cpus)
    result: dict[str, Any] = {"wall_s": {"ray_init": time.time() - began}}
    try:
        for name, run in runs.items():
            began = time.time()
            result[name] = run()
            result["wall_s"][name] = time.time() - began
        return result
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)


def _summarise(args: argparse.Namespace, plan: Plan, rounds: dict[str, list[float]], counts: dict[str, list[int]],
               recoveries: dict[str, dict[str, Any]], extras: dict[str, dict[str, Any]], errors: dict[str, str],
               walls: dict[str, dict[str, float]], wall_s: float) -> dict[str, Any]:
    median = {name: statistics.median(values) if values else None for name, values in rounds.items()}
    elastic_recovery = recoveries.get("elastic", {})
    ray_recovery = recoveries.get("ray_train", {})
    return {
        "steady_step_ratio_vs_torch": _ratio(median["elastic"], median["torch_ddp"]),
        "report_every_step_ratio": _ratio(median["elastic_report"], median["elastic"]),
        "steps_lost": elastic_recovery.get("steps_lost"),
        "ray_train_steady_step_ratio_vs_torch": _ratio(median["ray_train"], median["torch_ddp"]),
        "ray_train_report_every_step_ratio": _ratio(median["ray_train_report"], median["ray_train"]),
        "ray_train_recovery_s": ray_recovery.get("recovery_s"),
        "ray_train_steps_lost": ray_recovery.get("steps_lost"),
        "checkpoint_stall_s": extras.get("checkpoint", {}).get("stall_s"),
        "checkpoint_stall_ratio_vs_plain_copy": extras.get("checkpoint", {}).get("stall_ratio_vs_plain_copy"),
        "checkpoint_write_mb_s": extras.get("checkpoint", {}).get("write_mb_s"),
        "checkpoint_write_ratio_vs_plain_pyarrow": extras.get("checkpoint", {}).get("write_ratio_vs_plain_pyarrow"),
        "hang_detect_s": extras.get("hang", {}).get("hang_detect_s"),
        "hang_detect_in_steps": extras.get("hang", {}).get("detect_in_steps"),
        "goodput_chaos": extras.get("chaos", {}).get("goodput"),
        "checkpoint": extras.get("checkpoint"),
        "hang": extras.get("hang"),
        "chaos": extras.get("chaos"),
        "median_step_s": median,
        "round_median_step_s": rounds,
        "round_steady_steps": counts,
        "recovery": {"elastic": elastic_recovery, "ray_train": ray_recovery},
        "definitions": {
            "median_step_s": f"median gap between rank 0's consecutive step completions at world size "
                             f"{workload.WORLD_SIZE}, after {workload.WARMUP_STEPS} warm-up steps; median over rounds",
            "recovery.<system>.recovery_s, ray_train_recovery_s": "rank 1 killed at the start of a step: from the "
                "completion of the step before the kill to the first step completed after the heal (elastic) or "
                "restart (Ray Train), on rank 0",
            "steps_lost": "elastic: steps_lost of the controller's recovery event (the step in flight when the peer "
                          "died counts); Ray Train: completed steps rolled back to the last checkpoint",
            "ray_train_report_every_step_ratio": "a Ray Train worker hands its reports to the controller through a "
                                                 "queue of one, emptied once per poll of the workers, so reporting "
                                                 "every step paces the steps to the poll interval",
        },
        "ray_train": {
            "v2": is_v2_enabled(),
            "poll_interval_s": float(os.environ.get(HEALTH_CHECK_INTERVAL_S_ENV_VAR, DEFAULT_HEALTH_CHECK_INTERVAL_S)),
        },
        "workload": {
            "model": f"MLP {workload.IN_FEATURES}-{workload.HIDDEN}-{workload.HIDDEN}-{workload.CLASSES} ReLU",
            "optimizer": f"SGD lr={workload.LR}",
            "world_size": workload.WORLD_SIZE,
            "global_batch_size": workload.GLOBAL_BATCH,
            "per_worker_batch": workload.GLOBAL_BATCH // workload.WORLD_SIZE,
            "num_samples": workload.NUM_SAMPLES,
            "backend": "gloo",
            "torch_threads_per_worker": 1,
        },
        "plan": {**plan.__dict__, "quick": args.quick},
        "errors": errors,
        "command": shlex.join([os.path.relpath(sys.executable, REPO_ROOT), "-m", "benchmarks.bench", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "phase_wall_s": walls,
        "versions": {"torch": torch.__version__, "ray": ray.__version__, "python": platform.python_version()},
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }


def _summarise_protocol(args: argparse.Namespace, plan: Plan, runs: dict[str, list[dict[str, Any]]],
                        errors: dict[str, str], walls: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The protocol figures: top-level medians for the README, and min/median/max with breakdowns under `protocol`."""
    fast, slow, spare = (runs[name] for name in PROTOCOL_SYSTEMS)
    recovery = {"fast": _recovery_spread(fast), "slow": _recovery_spread(slow), "spare": _recovery_spread(spare)}
    grow = {"fast": _grow_spread(fast), "slow": _grow_spread(slow)}
    full_size = {
        "no_spare": {k: _spread([r["full_size"][k] for r in fast])
                     for k in ("seconds", "replacement_start_s", "grow_s")},
        "spare": {"seconds": _spread([r["full_size"]["seconds"] for r in spare])},
    }
    return {
        "recovery_s": _median(recovery["fast"]["recovery_s"]),
        "recovery_fast_s": _median(recovery["fast"]["recovery_s"]),
        "recovery_slow_s": _median(recovery["slow"]["recovery_s"]),
        "grow_pause_fast_s": _median(grow["fast"]["pause_s"]),
        "grow_pause_slow_s": _median(grow["slow"]["pause_s"]),
        "full_size_after_death_no_spare_s": _median(full_size["no_spare"]["seconds"]),
        "full_size_after_death_spare_s": _median(full_size["spare"]["seconds"]),
        "protocol": {
            "recovery": recovery,
            "grow_pause": grow,
            "full_size_after_death": full_size,
            "goals": PROTOCOL_GOALS,
            "step_sleep_s": {"fast": 0.0, "slow": protocol_run.SLOW_STEP_SLEEP_S},
            "runs": runs,
            "plan": {**{k: v for k, v in plan.__dict__.items() if k.startswith("protocol_")},
                     "rounds": plan.rounds, "quick": args.quick},
            "errors": errors,
            "phase_wall_s": walls,
        },
    }


# Goals of issue 8, printed beside the figures and never enforced.
PROTOCOL_GOALS = {"recovery_s": 0.2, "grow_pause_s": 0.2, "full_size_after_death_spare_s": 1.0}
RECOVERY_FIELDS = ("recovery_s", "detect_s", "decide_s", "rendezvous_s", "sync_s", "other_s", "controller_s",
                   "barrier_s", "connect_s", "steps_lost")
PROTOCOL_DEFINITIONS = {
    "recovery_s": "recovery_fast_s, kept under its old name for the README",
    "recovery_fast_s, recovery_slow_s": "rank 1 killed inside the gradient all-reduce at ~15 ms and at ~1 s steps "
        "(min_workers=1, max_workers=2): from its death (the time of its fault_injected event, recorded just before "
        "it exits) to the commit of the healed generation (the time of the controller's recovery event); median over "
        "rounds. protocol.recovery.<fast|slow|spare> splits it into detect_s (death to the first sign the controller "
        "saw), decide_s (to the offer), rendezvous_s (barrier_s + connect_s), sync_s (each the most over the "
        "members) and other_s (the rest: messages, and members' time outside those phases, such as leaving the "
        "broken group); survivor_saw_failure_s is the death to rank 0's train loop seeing its step fail",
    "grow_pause_fast_s, grow_pause_slow_s": "the survivor's pause when the replacement joins (~4 s after the death): "
        "on rank 0, the gap before the switch step's completion less the median gap of the grown generation's later "
        "steps. protocol.grow_pause.<fast|slow>.event_pause_s is the grow's generation_formed pause_s, the most over "
        "all members of barrier+connect+sync: it includes the newcomer's wait at the barrier for the members to reach "
        "the switch step, about two steps, so at 1 s steps it is not the survivors' pause",
    "full_size_after_death_no_spare_s": "at ~15 ms steps, from the death to the commit of the grow back to "
        "max_workers; protocol.full_size_after_death.no_spare splits it into the replacement's start and the grow",
    "full_size_after_death_spare_s": "at ~15 ms steps with ScalingConfig(spare_workers=1): from the death to the "
        "commit of the heal, which takes the spare and stays at max_workers",
    "protocol.goals": "the goals of issue 8 (recovery at any step time, grow pause, back to full size with a spare), "
        "printed beside the medians and not enforced",
}


def _recovery_spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        **{k: _spread([r["recovery"][k] for r in runs]) for k in RECOVERY_FIELDS},
        "survivor_saw_failure_s": _spread([r["survivor_saw_failure_s"] for r in runs]),
        "step_s": _spread([r["step_s"] for r in runs]),
        "from_checkpoint": [r["recovery"]["from_checkpoint"] for r in runs],
    }


def _grow_spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "pause_s": _spread([r["grow"]["pause_from_steps_s"] for r in runs]),
        "event_pause_s": _spread([r["grow"]["pause_s"] for r in runs]),
        **{k: _spread([r["grow"][k] for r in runs]) for k in ("barrier_s", "connect_s", "sync_s")},
    }


def _spread(values: list[float | None]) -> dict[str, Any] | None:
    """Min, median and max over the rounds that measured the figure; the rounds' values as they came."""
    measured = [v for v in values if v is not None]
    if not measured:
        return None
    return {"min": min(measured), "median": statistics.median(measured), "max": max(measured), "rounds": values}


def _median(spread: dict[str, Any] | None) -> float | None:
    return spread["median"] if spread else None


def _provenance(wall_s: float) -> dict[str, Any]:
    return {
        "command": shlex.join([os.path.relpath(sys.executable, REPO_ROOT), "-m", "benchmarks.bench", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "wall_s": wall_s,
    }


def _read_report(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _merge(existing: dict[str, Any], protocol: dict[str, Any], provenance: dict[str, Any]) -> dict[str, Any]:
    """`existing` with the protocol's keys replaced, and `produced_by` saying which command wrote which keys."""
    written = sorted(protocol) + [f"definitions.{name}" for name in PROTOCOL_DEFINITIONS]
    earlier = existing.get("produced_by")
    if earlier is None and existing:
        # A report from before produced_by: one full run wrote all of it.
        earlier = [{**{k: existing.get(k) for k in ("command", "date", "git_commit", "wall_s")},
                    "keys": sorted(existing)}]
    kept = [{**entry, "keys": [k for k in entry["keys"] if k not in written]} for entry in earlier or []]
    report = {**existing, **protocol}
    report["definitions"] = {**existing.get("definitions", {}), **PROTOCOL_DEFINITIONS}
    report["produced_by"] = [entry for entry in kept if entry["keys"]] + [{**provenance, "keys": written}]
    return report


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _print_table(report: dict[str, Any]) -> None:
    if "median_step_s" in report:
        _print_systems_table(report)
    if "protocol" in report:
        _print_protocol_table(report["protocol"])


def _print_protocol_table(protocol: dict[str, Any]) -> None:
    recovery, grow, full = protocol["recovery"], protocol["grow_pause"], protocol["full_size_after_death"]
    goals = protocol["goals"]
    rows = [
        ("recovery, 15 ms steps (death to commit)", recovery["fast"]["recovery_s"], goals["recovery_s"]),
        ("recovery, 1 s steps", recovery["slow"]["recovery_s"], goals["recovery_s"]),
        ("grow pause, 15 ms steps (survivor)", grow["fast"]["pause_s"], goals["grow_pause_s"]),
        ("grow pause, 1 s steps", grow["slow"]["pause_s"], goals["grow_pause_s"]),
        ("back to max_workers after a death, no spare", full["no_spare"]["seconds"], None),
        ("back to max_workers after a death, 1 spare", full["spare"]["seconds"],
         goals["full_size_after_death_spare_s"]),
    ]
    rounds = protocol["plan"]["rounds"]
    title = f"healing protocol, rank 1 killed mid all-reduce ({rounds} round{'s' if rounds != 1 else ''}), s"
    header = (f"{title:<58}"
              f"{'min':>7}{'median':>8}{'max':>7}{'goal':>8}")
    print("\n" + header + "\n" + "-" * (len(header) + 9))
    for label, spread, goal in rows:
        spread = spread or {}
        verdict = "" if goal is None or spread.get("median") is None else (
            "  met" if spread["median"] <= goal else "  missed")
        print(f"{label:<58}{_fmt(spread.get('min'), 1, '.3f'):>7}{_fmt(spread.get('median'), 1, '.3f'):>8}"
              f"{_fmt(spread.get('max'), 1, '.3f'):>7}{('<= ' + format(goal, '.1f')) if goal else '':>8}{verdict}")
    for name, label in (("fast", "15 ms"), ("slow", "1 s")):
        parts = recovery[name]
        split = " + ".join(f"{key[:-2]} {_fmt(_median(parts[key]), 1000, '.0f')}"
                           for key in ("detect_s", "decide_s", "rendezvous_s", "sync_s", "other_s"))
        print(f"recovery at {label} steps, medians in ms: {split}")
    no_spare = full["no_spare"]
    print(f"back to max_workers without a spare, medians: replacement starts in "
          f"{_fmt(_median(no_spare['replacement_start_s']), 1, '.2f')} s, then grows in "
          f"{_fmt(_median(no_spare['grow_s']), 1, '.2f')} s")
    if protocol["errors"]:
        print(f"protocol runs that failed: {', '.join(protocol['errors'])}")


def _print_systems_table(report: dict[str, Any]) -> None:
    median = report["median_step_s"]
    recovery = report["recovery"]
    rows = [
        ("torch DDP (gloo)", median["torch_ddp"], 1.0 if median["torch_ddp"] else None, None, None, None),
        ("Ray Train", median["ray_train"], report["ray_train_steady_step_ratio_vs_torch"],
         report["ray_train_report_every_step_ratio"], recovery["ray_train"].get("recovery_s"),
         recovery["ray_train"].get("steps_lost")),
        ("elastic", median["elastic"], report["steady_step_ratio_vs_torch"], report["report_every_step_ratio"],
         recovery["elastic"].get("recovery_s"), recovery["elastic"].get("steps_lost")),
    ]
    header = f"{'system':<18}{'step ms':>9}{'vs torch':>10}{'report x':>10}{'recovery s':>12}{'steps lost':>12}"
    print("\n" + header + "\n" + "-" * len(header))
    for name, step_s, vs_torch, report_x, recovery_s, lost in rows:
        print(f"{name:<18}{_fmt(step_s, 1000, '.2f'):>9}{_fmt(vs_torch, 1, '.3f'):>10}{_fmt(report_x, 1, '.3f'):>10}"
              f"{_fmt(recovery_s, 1, '.2f'):>12}{_fmt(lost, 1, 'd'):>12}")
    print(f"\nelastic checkpoint stall {_fmt(report['checkpoint_stall_s'], 1000, '.2f')} ms "
          f"({_fmt(report['checkpoint_stall_ratio_vs_plain_copy'], 1, '.2f')}x a plain copy); write "
          f"{_fmt(report['checkpoint_write_mb_s'], 1, '.0f')} MB/s "
          f"({_fmt(report['checkpoint_write_ratio_vs_plain_pyarrow'], 1, '.2f')}x a plain pyarrow write)")
    print(f"elastic hang detected after {_fmt(report['hang_detect_s'], 1, '.2f')} s "
          f"({_fmt(report['hang_detect_in_steps'], 1, '.0f')} median steps); goodput with a kill about every 10 s: "
          f"{_fmt(report['goodput_chaos'], 1, '.3f')}")


def _fmt(value: float | int | None, scale: float, spec: str) -> str:
    if value is None:
        return "-"
    return format(int(value) if spec == "d" else value * scale, spec)


if __name__ == "__main__":
    sys.exit(main())
