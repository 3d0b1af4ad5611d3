"""Goodput under a failure every minute: elastic, Ray Train and torchft side by side, in one command.

    .venv/bin/python -m benchmarks.goodput                      # 3 rounds of 5-minute runs: about 3 hours
    .venv/bin/python -m benchmarks.goodput --duration 150 --calm 60 --rounds 1
    .venv/bin/python -m benchmarks.goodput --systems elastic,ray_train --settings per_60s

Run it from the repository root. Every system trains the same work (`benchmarks/goodput_loop.py`:
a float64 Tanh MLP whose step is padded to about 0.5 s, a global batch of 128) with 4 workers,
each system in a subprocess of its own, in a process session that ends with its run:

- `elastic`: `ElasticTrainer`, 2 to 4 workers, no spare; heals in place; a checkpoint every
  100 steps (it never restores from one here);
- `elastic_spare`: the same with `spare_workers=1`;
- `ray_train`: Ray Train V2's `TorchTrainer` with its elastic range `num_workers=(2, 4)` and
  `FailureConfig(max_failures=-1)`, a checkpoint every 10 steps (Ray's docs leave N to the user;
  10 steps is 5 s of training, and each costs one report);
- `torchft`: torchft's `Manager` with its DDP wrapper and a Lighthouse, 4 replica groups of one
  process over gloo, its own recovery from a live peer (`benchmarks/goodput_torchft.py`).

Each run first trains fault-free for `--calm` seconds (that system's fault-free rate), then once
per setting for `--duration` seconds from its first committed step while this script SIGKILLs
a random training process every 60 s (`per_60s`) or 15 s (`per_15s`). Ray (or, for torchft,
the script's supervisor) starts the capacity again, as a cloud's autoscaler would.

Per system and setting:
- `goodput.<setting>.<system>`: committed samples per second over the window divided by that
  system's fault-free rate. Committed means in the run's final lineage: a step redone after a
  restore from a checkpoint counts once, the undone attempt not at all;
- `goodput_steps_lost.<setting>.<system>`: committed steps redone after each death (median);
- `goodput_recovery_s.<setting>.<system>`: seconds from each death to the next committed step (median);
- `goodput_final_probe_loss.<setting>.<system>`: the loss on a fixed probe batch at the last probed step;
- `goodput_probe_rel_diff.<setting>.<system>` (elastic): the largest relative difference of its probe
  losses from its fault-free run's at the same steps.
Min, median and max over the rounds land in benchmarks/results/bench.json (`merge_figures`), the
committed steps over wall time of the last round in benchmarks/results/goodput.png.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import goodput_loop
from benchmarks.bench import REPO_ROOT, command_line, kill_session, merge_figures, parse_rounds, print_medians

SYSTEMS = ("elastic", "elastic_spare", "ray_train", "torchft")
SETTINGS = {"per_60s": 60.0, "per_15s": 15.0}
# How long a system may take from its start to its first committed step.
START_TIMEOUT_S = 240.0
PLOT = os.path.join(REPO_ROOT, "benchmarks", "results", "goodput.png")
DEFINITIONS = {
    "goodput": "committed samples per second over the window / the same system's fault-free rate (benchmarks/goodput.py)",
    "goodput_steps_lost": "committed steps redone after each death: the median over the run's deaths",
    "goodput_recovery_s": "seconds from each death to the next committed step: the median over the run's deaths",
    "goodput_final_probe_loss": "loss on a fixed probe batch at the last probed step in the window",
    "goodput_probe_rel_diff": "elastic: largest relative difference of its probe losses from its fault-free run's",
}


def main(argv: list[str] | None = None) -> int:
    def more(parser: Any) -> None:
        parser.add_argument("--duration", type=float, default=300.0, help="seconds of each run with failures")
        parser.add_argument("--calm", type=float, default=120.0, help="seconds of each fault-free run")
        parser.add_argument("--systems", default=",".join(SYSTEMS))
        parser.add_argument("--settings", default=",".join(SETTINGS))
        parser.add_argument("--seed", type=int, default=0)

    parser, args = parse_rounds(__doc__, argv, more)
    systems = args.systems.split(",")
    settings = args.settings.split(",")
    for name in systems:
        if name not in SYSTEMS:
            parser.error(f"--systems: {name!r} is none of {', '.join(SYSTEMS)}")
    for name in settings:
        if name not in SETTINGS:
            parser.error(f"--settings: {name!r} is none of {', '.join(SETTINGS)}")
    began = time.time()
    killer = random.Random(args.seed)
    figures: dict[str, list[float | None]] = {}
    timelines: dict[str, dict[str, list[tuple[float, int]]]] = {setting: {} for setting in settings}
    runs: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for system in systems:
            calm = _run_or_say(system, args.calm, None, killer)
            if calm is None:
                continue  # its figures stay None in this round
            runs.append({"round": round_index, "system": system, "setting": "calm", **_brief(calm)})
            for setting in settings:
                outcome = _run_or_say(system, args.duration, SETTINGS[setting], killer)
                if outcome is None:
                    continue
                runs.append({"round": round_index, "system": system, "setting": setting, **_brief(outcome)})
                timelines[setting][system] = outcome["timeline"]
                for key, value in _figures(outcome, calm, system).items():
                    figures.setdefault(f"{key}.{setting}.{system}", [None] * args.rounds)[round_index] = value
    wall_s = time.time() - began
    details = {"goodput_runs": runs, "goodput_workload": {
        "step_s": goodput_loop.STEP_S, "workers": goodput_loop.WORKERS, "global_batch": goodput_loop.GLOBAL_BATCH,
        "duration_s": args.duration, "calm_s": args.calm}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.goodput", argv), wall_s)
    _plot(timelines)
    print_medians(figures)
    return 0


def run(system: str, duration_s: float, kill_every_s: float | None, rng: random.Random) -> dict[str, Any]:
    """Run `system` for `duration_s` seconds from its first committed step, killing a random training
    process every `kill_every_s` seconds (never if None); what its processes recorded."""
    out_dir = tempfile.mkdtemp(prefix=f"goodput-{system}-")
    label = f"{system} {'fault-free' if kill_every_s is None else f'a kill every {kill_every_s:.0f} s'}"
    print(f"[goodput] {label} ...", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    with open(os.path.join(out_dir, "system.log"), "w") as log:
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.goodput_systems", system, out_dir],
                                 cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deaths: list[dict[str, Any]] = []
    try:
        first = _first_commit(out_dir, child)
        end = first + duration_s
        next_kill = first + kill_every_s if kill_every_s is not None else float("inf")
        while time.time() < end:
            if child.poll() is not None:
                raise RuntimeError(f"{system} exited with code {child.returncode}: see {out_dir}/system.log")
            if time.time() >= next_kill:
                victim = _kill_one(out_dir, rng)
                if victim is not None:
                    deaths.append({"t": time.time(), "pid": victim})
                next_kill += kill_every_s
            time.sleep(0.05)
    finally:
        kill_session(child.pid)
        child.wait()
    stamps = [s for s in goodput_loop.read_stamps(out_dir) if s["t"] <= end]
    outcome = summarise(stamps, deaths, first, end)
    print(f"[goodput] {label}: {outcome['committed_steps']} steps committed, {len(deaths)} deaths, "
          f"{outcome['samples_per_s']:.1f} samples/s ({out_dir})", flush=True)
    return outcome


def _run_or_say(system: str, duration_s: float, kill_every_s: float | None, rng: random.Random) -> dict[str, Any] | None:
    """`run`, or None once it said why the system failed: one failed run does not lose the others' figures."""
    try:
        return run(system, duration_s, kill_every_s, rng)
    except RuntimeError as exc:
        print(f"[goodput] {system} FAILED: {exc}", flush=True)
        return None


def summarise(stamps: list[dict[str, Any]], deaths: list[dict[str, Any]], first: float, end: float) -> dict[str, Any]:
    """What a run committed between `first` and `end`, from its processes' stamps.

    The final lineage: a stamp of step s undoes every later step recorded before it (a restore
    from a checkpoint redoes them), so each step counts once, with its last attempt's samples.
    """
    lineage: dict[int, dict[str, Any]] = {}
    timeline: list[tuple[float, int]] = []
    for stamp in stamps:
        for step in [s for s in lineage if s >= stamp["step"]]:
            del lineage[step]
        lineage[stamp["step"]] = stamp
        timeline.append((stamp["t"] - first, len(lineage)))
    samples = sum(stamp["samples"] for stamp in lineage.values())
    probes = {step: stamp["probe"] for step, stamp in lineage.items() if "probe" in stamp}
    return {
        "samples_per_s": samples / (end - first),
        "committed_steps": len(lineage),
        "steps_once": sorted(lineage) == list(range(min(lineage, default=0), max(lineage, default=-1) + 1)),
        "deaths": [_recovery(stamps, death) for death in deaths],
        "probes": probes,
        "timeline": timeline,
    }


def _recovery(stamps: list[dict[str, Any]], death: dict[str, Any]) -> dict[str, Any]:
    """How a death at `death["t"]` was recovered: seconds to the next committed step, steps redone."""
    before = [s["step"] for s in stamps if s["t"] <= death["t"]]
    after = [s for s in stamps if s["t"] > death["t"]]
    if not before or not after:
        return {"t": death["t"], "recovery_s": None, "steps_lost": None}
    return {"t": death["t"], "recovery_s": after[0]["t"] - death["t"],
            "steps_lost": max(0, before[-1] - after[0]["step"] + 1)}


def _figures(outcome: dict[str, Any], calm: dict[str, Any], system: str) -> dict[str, float | None]:
    recoveries = [d["recovery_s"] for d in outcome["deaths"] if d["recovery_s"] is not None]
    lost = [d["steps_lost"] for d in outcome["deaths"] if d["steps_lost"] is not None]
    probes = outcome["probes"]
    figures = {
        "goodput": outcome["samples_per_s"] / calm["samples_per_s"],
        "goodput_recovery_s": statistics.median(recoveries) if recoveries else None,
        "goodput_steps_lost": statistics.median(lost) if lost else None,
        "goodput_final_probe_loss": probes[max(probes)] if probes else None,
    }
    if system.startswith("elastic"):
        # elastic's math is the same at every world size: its probes match its fault-free run's.
        shared = set(probes) & set(calm["probes"])
        figures["goodput_probe_rel_diff"] = max((abs(probes[s] - calm["probes"][s]) / abs(calm["probes"][s]) for s in shared),
                                        default=None)
    return figures


def _brief(outcome: dict[str, Any]) -> dict[str, Any]:
    return {key: outcome[key] for key in ("samples_per_s", "committed_steps", "steps_once", "deaths")}


def _first_commit(out_dir: str, child: subprocess.Popen) -> float:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        stamps = goodput_loop.read_stamps(out_dir)
        if stamps:
            return stamps[0]["t"]
        if child.poll() is not None:
            raise RuntimeError(f"exited with code {child.returncode} before its first step: see {out_dir}/system.log")
        time.sleep(0.1)
    raise RuntimeError(f"no step committed within {START_TIMEOUT_S:.0f} s: see {out_dir}/system.log")


def _kill_one(out_dir: str, rng: random.Random) -> int | None:
    """SIGKILL a random announced training process that is still alive; its pid, or None if none is."""
    alive = [pid for pid in goodput_loop.announced(out_dir) if _alive(pid)]
    if not alive:
        return None
    victim = rng.choice(alive)
    os.kill(victim, signal.SIGKILL)
    return victim


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _plot(timelines: dict[str, dict[str, list[tuple[float, int]]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(timelines), figsize=(6 * len(timelines), 4), squeeze=False)
    for ax, (setting, systems) in zip(axes[0], timelines.items()):
        for system, timeline in systems.items():
            ax.step([t for t, _ in timeline], [n for _, n in timeline], where="post", label=system)
        ax.set_title(f"a SIGKILL every {SETTINGS[setting]:.0f} s")
        ax.set_xlabel("seconds since the first committed step")
        ax.set_ylabel("committed steps")
        ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    with open(os.path.splitext(PLOT)[0] + ".json", "w") as f:
        json.dump(timelines, f)


if __name__ == "__main__":
    sys.exit(main())
