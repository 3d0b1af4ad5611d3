"""Plain torch DDP, Ray Train and elastic side by side on one fixed workload, in one command.

    .venv/bin/python -m benchmarks.bench                   # full run, 3 rounds, about 15 minutes
    .venv/bin/python -m benchmarks.bench --quick           # fewer steps, one round, about 5 minutes
    .venv/bin/python -m benchmarks.bench --only protocol   # the healing protocol's figures alone, about 5 minutes
    .venv/bin/python -m benchmarks.bench --only steady     # plain DDP (bare, beside an idle Ray) and elastic's steady steps
    .venv/bin/python -m benchmarks.bench --out /tmp/bench.json

Run it from the repository root. The workload (benchmarks/workload.py) is an MLP
256-1024-1024-10 trained with SGD by 2 CPU workers over gloo, 64 samples per worker per step,
one torch thread per worker process. Measured:

- median step time without reporting, for all three systems, and with a metrics report every
  step for Ray Train (`ray.train.report`) and elastic (`elastic.report`). Plain DDP runs twice:
  bare, and beside an idle Ray instance started exactly as the Ray systems start theirs. On a
  machine with few cores Ray's own daemons take CPU from whatever runs beside them, so the
  elastic and Ray Train ratios against DDP-with-Ray compare like with like; the bare ratios
  stay for reference;
- recovery: rank 1 dies at the start of a step; the time from its death to the next completed
  step, and how many steps were lost;
- the healing protocol (benchmarks/protocol_run.py): rank 1 dies mid all-reduce at 15 ms and at
  1 s steps; the recovery from death to the healed generation's commit with its breakdown, the
  survivor's pause when the replacement joins, and the time back to max_workers with and
  without a warm spare.

Each system runs in its own subprocess (and Ray session) per round, so a hang or a crash in
one cannot skew the next. The systems take turns for `--rounds` rounds, so a burst of load on
the machine hits every system alike, and a ratio between two systems is taken within each
round. Every figure is reported as the median over its rounds at the top level of the JSON
and as `spread[<key>] = {min, median, max, rounds, disagree}` beside it (a dotted key such as
`median_step_s.elastic` names a nested figure); `disagree` is set, and the printed table
flags the figure, when (max - min) / median exceeds DISAGREE_FRACTION. Three runs happen in
the first round only, so their figures have one round: Ray Train's reporting run (each of its
steps lasts one poll of its controller, ~2 s, so a repeat costs minutes and tells nothing
new), elastic's checkpoint run and its chaos run (70 s). The JSON lands in
benchmarks/results/bench.json unless --out says otherwise; a short table is printed.
`--only protocol` merges its keys into the JSON already at --out and keeps the others, and so
does `--only steady`, which runs plain DDP, plain DDP beside an idle Ray and elastic's steady
runs alone (no Ray Train, no recovery, checkpoint, hang or chaos run);
`produced_by` records which command wrote which keys, and when. Another script merges its own
figures the same way with `merge_figures` (benchmarks/checkpoint_run.py does), and a full run
keeps what other scripts merged.
"""

from __future__ import annotations

import argparse
import copy
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
from typing import Any, Callable

import ray
import torch

# Ray Train (benchmarks.ray_train) is imported only where it is measured: a driver that imported
# ray.train (through ray.data) healed elastic's deaths ~0.2 s slower, the controller's commit
# waiting after the survivor had formed (0.29 s against 0.06 s at 15 ms steps, one round each).
from benchmarks import elastic_run, protocol_run, torch_ddp, workload

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results", "bench.json")
SYSTEMS = ("torch_ddp", "torch_ddp_with_ray", "ray_train", "elastic")
# The healing protocol's runs, each in a subprocess of its own (benchmarks/protocol_run.py).
PROTOCOL_SYSTEMS = ("protocol_fast", "protocol_slow", "protocol_spare")
# The steady step's figures alone: elastic runs only its steady runs (`steady_only`).
STEADY_SYSTEMS = ("torch_ddp", "torch_ddp_with_ray", "elastic")
ONLY = {"protocol": PROTOCOL_SYSTEMS, "steady": STEADY_SYSTEMS}
STEADY_FIGURES = ("steady_step_ratio_vs_torch_with_ray", "steady_step_ratio_vs_torch", "idle_ray_step_ratio",
                  "report_every_step_ratio")
STEADY_DEFINITIONS = ("spread", "median_step_s", "steady_step_ratio_vs_torch_with_ray, steady_step_ratio_vs_torch",
                      "idle_ray_step_ratio", "report_every_step_ratio, ray_train_report_every_step_ratio")
STEADY_ALONE_DEFINITION = ("`--only steady`'s run: its steps and rounds, the steady steps each of its runs counted in "
                           "each round, and the measurements that failed")
STEADY_RUNS = ("torch_ddp", "torch_ddp_with_ray", "ray_train", "ray_train_report", "elastic", "elastic_report")
# A figure whose rounds spread wider than this fraction of their median is flagged: (max - min) / median.
DISAGREE_FRACTION = 0.1
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
    # Each system's outcome in each round, None where the round's subprocess failed.
    outcomes: dict[str, list[dict[str, Any] | None]] = {system: [] for system in systems}
    walls: dict[str, dict[str, float]] = {}
    for round_index in range(plan.rounds):
        for system in systems:
            label = f"{system}-round{round_index}"
            params = {**plan.__dict__, "first_round": round_index == 0, "steady_only": args.only == "steady"}
            outcome = _measure_in_subprocess(label, system, params, plan.timeout_s, log_dir)
            if "error" in outcome:
                errors[label] = outcome["error"]
                outcomes[system].append(None)
                continue
            walls[label] = outcome.pop("wall_s")
            outcomes[system].append(outcome)
    if args.only == "steady":
        step_times, steady_steps, step_errors = _step_times(outcomes)
        errors.update(step_errors)
        figures = {key: values for key, values in _steady_figures(step_times).items() if key in STEADY_FIGURES}
        figures.update({f"median_step_s.{name}": values for name, values in step_times.items() if values})
        details = {"steady_alone": {"steps": plan.steps, "rounds": plan.rounds, "errors": errors,
                                    "round_steady_steps": {name: n for name, n in steady_steps.items() if n}}}
        definitions = {key: DEFINITIONS[key] for key in STEADY_DEFINITIONS}
        merge_figures(args.out, figures, details, {**definitions, "steady_alone": STEADY_ALONE_DEFINITION},
                      _command(), time.time() - started)
        print_medians(figures)
    else:
        protocol_runs = {name: [o["protocol"] for o in outcomes.get(name, []) if o] for name in PROTOCOL_SYSTEMS}
        protocol_errors = {label: why for label, why in errors.items() if label.startswith(PROTOCOL_SYSTEMS)}
        protocol_walls = {label: wall for label, wall in walls.items() if label.startswith(PROTOCOL_SYSTEMS)}
        protocol_figures, protocol = _summarise_protocol(args, plan, protocol_runs, protocol_errors, protocol_walls)
        if args.only == "protocol":
            report = merge_figures(args.out, protocol_figures, protocol, PROTOCOL_DEFINITIONS,
                                   _command(), time.time() - started)
        else:
            step_times, steady_steps, step_errors = _step_times(outcomes)
            errors.update(step_errors)
            figures, details = _summarise(args, plan, outcomes, step_times, steady_steps, errors, walls,
                                          time.time() - started)
            report = _add_figures({**details, **protocol}, {**figures, **protocol_figures})
            report["definitions"] = {**DEFINITIONS, **PROTOCOL_DEFINITIONS}
            report["produced_by"] = [{**_provenance(_command(), time.time() - started), "keys": sorted(report)}]
            try:
                existing = read_report(args.out)
            except (OSError, ValueError) as exc:
                print(f"[bench] replacing {args.out} whole: it could not be read ({exc})", file=sys.stderr)
                existing = {}
            _write_report(args.out, _keep_merged_by_others(existing, report))
        _print_table(report)
    print(f"\nwrote {args.out}")
    if errors:
        print(f"{len(errors)} measurement(s) failed: {', '.join(errors)}; logs in {log_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps and one round; about 5 minutes, under 2 with --only protocol")
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
            kill_session(child.pid)
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


def kill_session(session_id: int) -> None:
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
        began = time.time()
        result = {"steady": torch_ddp.steady(params["steps"])}
        result["wall_s"] = {"steady": time.time() - began}
    else:
        result = _measure_on_ray(system, params)
    with open(result_path, "w") as f:
        json.dump(result, f)


def _measure_on_ray(system: str, params: dict[str, Any]) -> dict[str, Any]:
    """One system's runs of one round, in one Ray session; some only in the first round."""
    if system == "torch_ddp_with_ray":
        runs = {"settle": _settle_ray, "steady": lambda: torch_ddp.steady(params["steps"])}
        once = ()
    elif system == "ray_train":
        from benchmarks import ray_train

        runs = {
            "steady": lambda: ray_train.steady(params["steps"], report=False, storage=storage),
            "report": lambda: ray_train.steady(params["ray_report_steps"], report=True, storage=storage),
            "recovery": lambda: ray_train.recovery(params["recovery_steps"], params["kill_step"],
                                                   params["ray_checkpoint_every"], storage),
        }
        once = ("report",)
    elif system == "elastic":
        runs = {
            "steady": lambda: elastic_run.steady(params["steps"], report=False, storage=storage),
            "report": lambda: elastic_run.steady(params["steps"], report=True, storage=storage),
            "recovery": lambda: elastic_run.recovery(params["recovery_steps"], params["kill_step"], storage),
            "checkpoint": lambda: elastic_run.checkpoint(params["checkpoint_steps"], 10, storage),
            "hang": lambda: elastic_run.hang(params["recovery_steps"], params["kill_step"], storage),
            "chaos": lambda: elastic_run.chaos(params["chaos_steps"], params["chaos_every_steps"], storage),
        }
        if params["steady_only"]:
            runs = {name: runs[name] for name in ("steady", "report")}
        once = ("checkpoint", "chaos")
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
            outcome = run()
            if outcome is not None:
                result[name] = outcome
            result["wall_s"][name] = time.time() - began
        return result
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)


@ray.remote(num_cpus=1)
def _noop() -> None:
    return None


def _settle_ray() -> None:
    """Wait until the Ray instance is idle: one task per logical CPU returns once a worker process is up.

    ray.init returns while the worker processes Ray starts ahead of demand are still starting;
    training at once would share the cores with that burst. The Ray systems train only once
    their actors are up, so this waits likewise; afterwards only the daemons and idle workers
    remain.
    """
    ray.get([_noop.remote() for _ in range(int(ray.cluster_resources().get("CPU", 1)))])


def _step_times(outcomes: dict[str, list[dict[str, Any] | None]]
                ) -> tuple[dict[str, list[float | None]], dict[str, list[int | None]], dict[str, str]]:
    """Each steady run's median step time and count of steady steps in each round (None where it did not run),
    and the runs that had no steady steps."""
    times: dict[str, list[float | None]] = {name: [] for name in STEADY_RUNS}
    counts: dict[str, list[int | None]] = {name: [] for name in STEADY_RUNS}
    errors: dict[str, str] = {}
    for system in (system for system in SYSTEMS if system in outcomes):
        for run, name in (("steady", system), ("report", f"{system}_report")):
            if name not in STEADY_RUNS:
                continue
            for round_index, outcome in enumerate(outcomes[system]):
                stamps = outcome.get(run) if outcome else None
                gaps = workload.steady_gaps(stamps) if stamps is not None else None
                if stamps is not None and not gaps:
                    errors[f"{system}-round{round_index}-{run}"] = (
                        f"no steady steps among {len(stamps)} at world size {workload.WORLD_SIZE} past the warm-up; "
                        f"run more steps")
                times[name].append(statistics.median(gaps) if gaps else None)
                counts[name].append(len(gaps) if gaps is not None else None)
    return times, counts, errors


def _summarise(args: argparse.Namespace, plan: Plan, outcomes: dict[str, list[dict[str, Any] | None]],
               step_times: dict[str, list[float | None]], steady_steps: dict[str, list[int | None]],
               errors: dict[str, str],
               walls: dict[str, dict[str, float]], wall_s: float) -> tuple[dict[str, list[float | None]],
                                                                           dict[str, Any]]:
    """The systems' figures, each as its values over the rounds, and the details beside them."""
    from ray.train.v2._internal.constants import (
        DEFAULT_HEALTH_CHECK_INTERVAL_S,
        HEALTH_CHECK_INTERVAL_S_ENV_VAR,
        is_v2_enabled,
    )

    elastic, ray_runs = outcomes["elastic"], outcomes["ray_train"]
    figures = {
        **_steady_figures(step_times),
        "elastic_recovery_s": _field(elastic, "recovery", "recovery_s"),
        "steps_lost": _field(elastic, "recovery", "steps_lost"),
        "ray_train_recovery_s": _field(ray_runs, "recovery", "recovery_s"),
        "ray_train_steps_lost": _field(ray_runs, "recovery", "steps_lost"),
        "checkpoint_stall_s": _field(elastic, "checkpoint", "stall_s"),
        "checkpoint_stall_ratio_vs_plain_copy": _field(elastic, "checkpoint", "stall_ratio_vs_plain_copy"),
        "checkpoint_write_mb_s": _field(elastic, "checkpoint", "write_mb_s"),
        "checkpoint_write_ratio_vs_plain_pyarrow": _field(elastic, "checkpoint", "write_ratio_vs_plain_pyarrow"),
        "hang_detect_s": _field(elastic, "hang", "hang_detect_s"),
        "hang_detect_in_steps": _field(elastic, "hang", "detect_in_steps"),
        "goodput_chaos": _field(elastic, "chaos", "goodput"),
        **{f"median_step_s.{name}": values for name, values in step_times.items()},
    }
    details = {
        # Each run's own figures in each round; null where the round did not run it or its subprocess failed.
        "recovery": {"elastic": _runs(elastic, "recovery"), "ray_train": _runs(ray_runs, "recovery")},
        "checkpoint": _runs(elastic, "checkpoint"),
        "hang": _runs(elastic, "hang"),
        "chaos": _runs(elastic, "chaos"),
        "round_steady_steps": steady_steps,
        "disagree_fraction": DISAGREE_FRACTION,
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
        "command": _command(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "phase_wall_s": walls,
        "versions": {"torch": torch.__version__, "ray": ray.__version__, "python": platform.python_version()},
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }
    return figures, details


DEFINITIONS = {
    "spread": "for each figure, keyed as at the top level (a dotted key names a nested one, e.g. "
              "median_step_s.elastic): min, median and max over the rounds that measured it, `rounds` (the values "
              "in round order, null where a round did not measure it) and `disagree`, true when (max - min) / median "
              "> disagree_fraction. The top-level value of a figure is its spread's median",
    "median_step_s": "median gap between rank 0's consecutive step completions at world size "
                     f"{workload.WORLD_SIZE}, after {workload.WARMUP_STEPS} warm-up steps, in each round; median over "
                     "rounds. torch_ddp_with_ray is the same plain DDP with the subprocess's Ray instance up and idle "
                     "(started as the Ray systems start theirs, and settled: one no-op task per CPU returned)",
    "steady_step_ratio_vs_torch_with_ray, steady_step_ratio_vs_torch": "elastic's median step time over plain DDP's "
        "with an idle Ray instance up (like with like: Ray's daemons take CPU on a small machine) and over bare "
        "plain DDP, taken within each round; median over rounds. ray_train_steady_step_ratio_vs_torch[_with_ray] "
        "likewise for Ray Train",
    "idle_ray_step_ratio": "plain DDP's step time with an idle Ray instance up over bare plain DDP's, within each "
                           "round: what Ray's daemons alone cost the training beside them",
    "report_every_step_ratio, ray_train_report_every_step_ratio": "the step time reporting metrics every step over "
        "the step time without, within each round. A Ray Train worker hands its reports to the controller through "
        "a queue of one, emptied once per poll of the workers, so reporting every step paces the steps to the poll "
        "interval; its reporting run happens in the first round only",
    "elastic_recovery_s, ray_train_recovery_s": "rank 1 killed at the start of a step: from the completion of the "
        "step before the kill to the first step completed after the heal (elastic) or restart (Ray Train), on "
        "rank 0. recovery.<system> holds each round's run",
    "steps_lost, ray_train_steps_lost": "elastic: steps_lost of the controller's recovery event (the step in flight "
                                        "when the peer died counts); Ray Train: completed steps rolled back to the "
                                        "last checkpoint",
    "checkpoint_*, goodput_chaos": "elastic's checkpoint run (a checkpoint every 10 steps) and chaos run (a kill "
                                   "about every 10 s) happen in the first round only",
}


def _steady_figures(step_times: dict[str, list[float | None]]) -> dict[str, list[float | None]]:
    """The steady step's ratios, round by round; a run that did not take place gives a ratio of None."""
    times = {name: step_times.get(name) or [] for name in STEADY_RUNS}
    return {
        "steady_step_ratio_vs_torch_with_ray": _ratios(times["elastic"], times["torch_ddp_with_ray"]),
        "steady_step_ratio_vs_torch": _ratios(times["elastic"], times["torch_ddp"]),
        "ray_train_steady_step_ratio_vs_torch_with_ray": _ratios(times["ray_train"], times["torch_ddp_with_ray"]),
        "ray_train_steady_step_ratio_vs_torch": _ratios(times["ray_train"], times["torch_ddp"]),
        "idle_ray_step_ratio": _ratios(times["torch_ddp_with_ray"], times["torch_ddp"]),
        "report_every_step_ratio": _ratios(times["elastic_report"], times["elastic"]),
        "ray_train_report_every_step_ratio": _ratios(times["ray_train_report"], times["ray_train"]),
    }


def _ratios(numerators: list[float | None], denominators: list[float | None]) -> list[float | None]:
    """Round by round: a ratio between two systems is taken within the round both ran in."""
    return [n / d if n is not None and d else None for n, d in zip(numerators, denominators)]


def _runs(outcomes: list[dict[str, Any] | None], run: str) -> list[dict[str, Any] | None]:
    return [outcome.get(run) if outcome else None for outcome in outcomes]


def _field(outcomes: list[dict[str, Any] | None], run: str, field: str) -> list[float | None]:
    return [result.get(field) if result else None for result in _runs(outcomes, run)]


def _summarise_protocol(args: argparse.Namespace, plan: Plan, runs: dict[str, list[dict[str, Any]]],
                        errors: dict[str, str], walls: dict[str, dict[str, float]]
                        ) -> tuple[dict[str, list[float | None]], dict[str, Any]]:
    """The protocol figures for the README, each as its values over the rounds, and min/median/max with
    breakdowns under `protocol`."""
    fast, slow, spare = (runs[name] for name in PROTOCOL_SYSTEMS)
    recovery = {"fast": _recovery_spread(fast), "slow": _recovery_spread(slow), "spare": _recovery_spread(spare)}
    grow = {"fast": _grow_spread(fast), "slow": _grow_spread(slow)}
    full_size = {
        "no_spare": {k: _spread([r["full_size"][k] for r in fast])
                     for k in ("seconds", "replacement_start_s", "grow_s")},
        "spare": {"seconds": _spread([r["full_size"]["seconds"] for r in spare])},
    }
    figures = {
        "recovery_s": [r["recovery"]["recovery_s"] for r in fast],
        "recovery_fast_s": [r["recovery"]["recovery_s"] for r in fast],
        "recovery_slow_s": [r["recovery"]["recovery_s"] for r in slow],
        "grow_pause_fast_s": [r["grow"]["pause_from_steps_s"] for r in fast],
        "grow_pause_slow_s": [r["grow"]["pause_from_steps_s"] for r in slow],
        "full_size_after_death_no_spare_s": [r["full_size"]["seconds"] for r in fast],
        "full_size_after_death_spare_s": [r["full_size"]["seconds"] for r in spare],
    }
    details = {
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
    return figures, details


# The protocol's figures at the top level; the protocol's table prints them.
PROTOCOL_FIGURES = ("recovery_s", "recovery_fast_s", "recovery_slow_s", "grow_pause_fast_s", "grow_pause_slow_s",
                    "full_size_after_death_no_spare_s", "full_size_after_death_spare_s")
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
    """Min, median and max over the rounds that measured the figure, the rounds' values as they came, and
    whether the rounds disagree: (max - min) / median > DISAGREE_FRACTION."""
    measured = [v for v in values if v is not None]
    if not measured:
        return None
    low, median, high = min(measured), statistics.median(measured), max(measured)
    return {"min": low, "median": median, "max": high, "rounds": values, "disagree": _disagree(low, median, high)}


def _disagree(low: float, median: float, high: float) -> bool:
    return (high - low) / abs(median) > DISAGREE_FRACTION if median else high != low


def _median(spread: dict[str, Any] | None) -> float | None:
    return spread["median"] if spread else None


def _add_figures(report: dict[str, Any], figures: dict[str, list[float | None]]) -> dict[str, Any]:
    """Put each figure's median under its key (a dotted key nests: `median_step_s.elastic`) and its spread
    under `spread`, keyed the same way; returns `report`."""
    spreads = report.setdefault("spread", {})
    for key, values in figures.items():
        spreads[key] = _spread(values)
        _set_path(report, key, _median(spreads[key]))
    return report


def _set_path(report: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for parent in parents:
        report = report.setdefault(parent, {})
    report[leaf] = value


def merge_figures(path: str, figures: dict[str, list[float | None]], details: dict[str, Any],
                  definitions: dict[str, str], command: str, wall_s: float) -> dict[str, Any]:
    """Merge figures measured by another command into the JSON report at `path` (created if absent) and write it.

    `figures` maps a key to the figure's values over the rounds (None for a round that did not
    measure it): its median lands under the key and its min, median and max under
    `spread.<key>`. `details` replace the top-level keys of the same names; `definitions` are
    merged into the report's. `produced_by` records that `command` wrote these keys, and when.
    Returns the merged report.
    """
    merged = _merge(read_report(path), figures, details, definitions, _provenance(command, wall_s))
    _write_report(path, merged)
    return merged


def print_medians(figures: dict[str, list[float | None]]) -> None:
    """Print each figure's median over the rounds that measured it ("-" where none did)."""
    width = max((len(key) for key in figures), default=0) + 1
    for key, values in sorted(figures.items()):
        present = [v for v in values if v is not None]
        print(f"{key:{width}s} {statistics.median(present):.4g}" if present else f"{key:{width}s} -")


def _command() -> str:
    return command_line("benchmarks.bench", None)


def parse_rounds(doc: str, argv: list[str] | None,
                 more: Callable[[argparse.ArgumentParser], None] | None = None,
                 ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser of a benchmark that takes `--rounds` (default 3, at least 1), `--out` and the
    arguments `more` adds, and its arguments."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT)
    if more is not None:
        more(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds({args.rounds}) must be at least 1")
    return parser, args


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that ran `module` with `argv` (sys.argv's when None), as the README quotes it."""
    return shlex.join([os.path.relpath(sys.executable, REPO_ROOT), "-m", module,
                       *(argv if argv is not None else sys.argv[1:])])


def _provenance(command: str, wall_s: float) -> dict[str, Any]:
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "wall_s": wall_s,
    }


def read_report(path: str) -> dict[str, Any]:
    """The JSON report at `path`, or {} where there is none yet."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_report(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _keep_merged_by_others(existing: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """`report` with the keys that other scripts (not this one) merged into `existing`, and their produced_by entries.

    A full run replaces what this script wrote before, but not, say, checkpoint_run.py's figures.
    """
    others = [entry for entry in existing.get("produced_by", [])
              if "benchmarks.bench" not in shlex.split(entry.get("command") or "")]
    kept = [{**entry, "keys": [key for key in entry["keys"] if _has(existing, key) and not _has(report, key)]}
            for entry in others]
    for key in sorted({key for entry in kept for key in entry["keys"]}):
        section, _, name = key.partition(".")
        if section in ("spread", "definitions"):
            report[section][name] = copy.deepcopy(existing[section][name])
        else:
            _set_path(report, key, copy.deepcopy(_get_path(existing, key)))
    report["produced_by"] = [entry for entry in kept if entry["keys"]] + report["produced_by"]
    return report


def _has(report: dict[str, Any], key: str) -> bool:
    """Whether `report` holds `key`: spread.<figure> and definitions.<name> name one entry, however dotted."""
    section, _, name = key.partition(".")
    if section in ("spread", "definitions") and name:
        return name in report.get(section, {})
    parts = key.split(".")
    for part in parts[:-1]:
        report = report.get(part)
        if not isinstance(report, dict):
            return False
    return parts[-1] in report


def _merge(existing: dict[str, Any], figures: dict[str, list[float | None]], details: dict[str, Any],
           definitions: dict[str, str], provenance: dict[str, Any]) -> dict[str, Any]:
    """`existing` with these figures and details replaced, and `produced_by` saying which command wrote which keys."""
    written = sorted({*figures, *details}) + [f"spread.{key}" for key in figures] + [
        f"definitions.{name}" for name in definitions]
    earlier = existing.get("produced_by")
    if earlier is None and existing:
        # A report from before produced_by: one full run wrote all of it.
        earlier = [{**{k: existing.get(k) for k in ("command", "date", "git_commit", "wall_s")},
                    "keys": sorted(existing)}]
    kept = [{**entry, "keys": [k for k in entry["keys"] if k not in written]} for entry in earlier or []]
    report = _add_figures({**copy.deepcopy(existing), **details}, figures)
    report["definitions"] = {**existing.get("definitions", {}), **definitions}
    report["produced_by"] = [entry for entry in kept if entry["keys"]] + [{**provenance, "keys": written}]
    return report


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
    if any(_flag(spread) for spread in report.get("spread", {}).values()):
        print(f"\n! its rounds disagree by more than {DISAGREE_FRACTION:.0%}: (max - min) / median > "
              f"{DISAGREE_FRACTION}; rerun, or quote it with its spread")


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
              f"{_fmt(spread.get('max'), 1, '.3f'):>7}{('<= ' + format(goal, '.1f')) if goal else '':>8}{verdict}"
              f"{_flag(spread)}")
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
    rows = [
        ("torch DDP (gloo)", "torch_ddp", None, None, None, None, None),
        ("torch DDP, idle Ray up", "torch_ddp_with_ray", None, "idle_ray_step_ratio", None, None, None),
        ("Ray Train", "ray_train", "ray_train_steady_step_ratio_vs_torch_with_ray",
         "ray_train_steady_step_ratio_vs_torch", "ray_train_report_every_step_ratio", "ray_train_recovery_s",
         "ray_train_steps_lost"),
        ("elastic", "elastic", "steady_step_ratio_vs_torch_with_ray", "steady_step_ratio_vs_torch",
         "report_every_step_ratio", "elastic_recovery_s", "steps_lost"),
    ]
    rounds = report["plan"]["rounds"]
    title = f"medians over {rounds} round{'s' if rounds != 1 else ''}"
    header = (f"{title:<24}{'step ms':>9}{'vs DDP+Ray':>12}{'vs DDP':>9}{'report x':>10}{'recovery s':>12}"
              f"{'steps lost':>12}")
    print("\n" + header + "\n" + "-" * len(header))
    for label, run, vs_ray, vs_bare, report_x, recovery_s, lost in rows:
        cells = [(f"median_step_s.{run}", 1000, ".2f", 9), (vs_ray, 1, ".3f", 12), (vs_bare, 1, ".3f", 9),
                 (report_x, 1, ".3f", 10), (recovery_s, 1, ".2f", 12), (lost, 1, ".3g", 12)]
        print((f"{label:<24}" + "".join(f"{_cell(report, key, scale, spec):>{width}}"
                                        for key, scale, spec, width in cells)).rstrip())
    print(f"\nelastic checkpoint stall {_fmt(report['checkpoint_stall_s'], 1000, '.2f')} ms "
          f"({_fmt(report['checkpoint_stall_ratio_vs_plain_copy'], 1, '.2f')}x a plain copy); write "
          f"{_fmt(report['checkpoint_write_mb_s'], 1, '.0f')} MB/s "
          f"({_fmt(report['checkpoint_write_ratio_vs_plain_pyarrow'], 1, '.2f')}x a plain pyarrow write)")
    print(f"elastic hang detected after {_fmt(report['hang_detect_s'], 1, '.2f')} s "
          f"({_fmt(report['hang_detect_in_steps'], 1, '.0f')} median steps); goodput with a kill about every 10 s: "
          f"{_fmt(report['goodput_chaos'], 1, '.3f')}")
    spreads = {key: spread for key, spread in report.get("spread", {}).items()
               if key not in PROTOCOL_FIGURES}
    if not spreads:
        return
    header = f"{'figure, over its rounds':<48}{'rounds':>7}{'min':>10}{'median':>10}{'max':>10}"
    print("\n" + header + "\n" + "-" * len(header))
    for key, spread in spreads.items():
        spread = spread or {}
        measured = sum(v is not None for v in spread.get("rounds", []))
        cells = "".join(f"{_fmt(spread.get(k), 1, '.4g'):>10}" for k in ("min", "median", "max"))
        print(f"{key:<48}{measured:>7}{cells}{_flag(spread)}")


def _cell(report: dict[str, Any], key: str | None, scale: float, spec: str) -> str:
    """A figure's median, flagged with `!` when its rounds disagree; a report from before `spread` has medians only."""
    if key is None:
        return ""
    spread = report.get("spread", {}).get(key)
    if spread is None:
        return _fmt(_get_path(report, key), scale, spec) + " "
    return _fmt(spread["median"], scale, spec) + ("!" if _flag(spread) else " ")


def _get_path(report: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        report = report.get(part) if isinstance(report, dict) else None
    return report


def _flag(spread: dict[str, Any] | None) -> str:
    if not spread or any(spread.get(k) is None for k in ("min", "median", "max")):
        return ""
    return " !" if _disagree(spread["min"], spread["median"], spread["max"]) else ""


def _fmt(value: float | int | None, scale: float, spec: str) -> str:
    if value is None:
        return "-"
    return format(int(value) if spec == "d" else value * scale, spec)


if __name__ == "__main__":
    sys.exit(main())
