"""How the healing protocol's costs grow with the world size, on a simulated multi-node cluster.

    .venv/bin/python -m benchmarks.scale            # world sizes 2, 4, 8, 16; 3 rounds
    .venv/bin/python -m benchmarks.scale --quick    # world sizes 2 and 16; 1 round
    .venv/bin/python -m benchmarks.scale --out /tmp/scale.json
    .venv/bin/python -m benchmarks.scale --simulated   # the pure protocol at 100 to 10,000 workers, no Ray

With --simulated it drives the controller's protocol with a fake worker group instead, and
merges its CPU figures into benchmarks/results/bench.json (benchmarks/scale_simulated.py says
what it measures).

Run it from the repository root. It starts a `ray.cluster_utils.Cluster` on this machine (a head
node with no CPUs for the driver and the controller, and NODES worker nodes of CPUS_PER_NODE
logical CPUs each) in a Ray temp dir of its own, so no other `ray.init()` on the machine finds
it, and shuts it down at the end. Every run of every round trains on that one cluster.

Each run trains a 16 -> 32 -> 1 MLP (SGD with momentum, so the optimizer has state to sync)
with min_workers = N-1 (1 for N = 2) and max_workers = N, and kills rank 1 inside its gradient
all-reduce at KILL_STEP (`Fault(kind="kill", rank=1, step=KILL_STEP, where="allreduce")`).
The survivors heal to N-1; the controller requests a replacement, and the run grows back to N
when it is ready. Every rank of the grown generation then stops after STEPS_AFTER_GROW steps,
at the same step, which ends the run. Until the kill, while the run is below N (workers still
starting), steps sleep WAITING_SLEEP_S so the kill finds all N ranks; after that each step
sleeps `--step-sleep` before its backward, standing for compute: 2 real cores host every
worker, and without it 16 processes spinning on them would measure the CPU scheduler.

Figures per world size, each as min, median and max over the rounds, read from the run's
journal (`Result.events`):

- recovery_s: from the death (the `fault_injected` event, which the dying rank has the
  controller record just before it exits) to the commit of the healed generation (the
  `recovery` event), with the event's breakdown: detect_s (death to the controller's first
  sign of it), decide_s (first sign to the offer that committed), controller_s (first sign
  to the commit), and the survivors' phases leave_s, barrier_s, connect_s, sync_s. Each
  phase is the slowest survivor's, so they overlap and do not add up to the total;
- grow_pause_s: `pause_s` of the grow back to N (`generation_formed` of kind "grow"): the
  longest pause of a running member, from leaving the old group to training in the new one;
- decide_s, as above: the controller's decision time;
- bytes_per_rank: bytes each rank of the healed generation sends in the state sync, as min,
  median and max over its ranks. Not measured on the wire: computed from what the sync sends
  (`elastic.comm.state_sync`): an all-gather of each rank's step and whether it holds live state
  (two int64; gloo's ring: W-1 sends of them per rank). Here that is all: the kill lands
  before rank 1 starts its all-reduce, so no survivor commits the step and all hold the same
  state. `bytes_per_rank_one_ahead` is the heal in which one survivor had committed a step
  more: the source then also broadcasts the pickled structure (a size, then the bytes) and
  one flat buffer per dtype, along gloo's binomial tree, so the source sends ceil(log2 W)
  copies, inner ranks fewer, leaves none. DDP's parameter-shape check at the rebuild (a few
  bytes per parameter) is left out.

The JSON (benchmarks/results/scale.json unless --out) holds `scaling` (per world size),
`recovery_ratio_16_vs_2` (median recovery at 16 over median at 2), the setup, the command,
date and git commit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import ray
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import elastic
from benchmarks import scale_simulated
from benchmarks.bench import DEFAULT_OUT as BENCH_OUT
from benchmarks.bench import _provenance, command_line
from elastic.comm.flat_state import flatten
from elastic.comm.state_sync import state_of

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results", "scale.json")
WORLD_SIZES = (2, 4, 8, 16)
QUICK_WORLD_SIZES = (2, 16)
SIMULATED_QUICK_SIZES = (100, 1000)
ROUNDS = 3
NODES = 4
CPUS_PER_NODE = 5  # logical: 16 workers and the replacement of a dead one fit with room to spare
IN_FEATURES, HIDDEN = 16, 32
NUM_SAMPLES = 4096
GLOBAL_BATCH = 64  # every world size up to 16 gets at least 4 samples per step
LR, MOMENTUM = 0.01, 0.9
SEED = 0
KILL_STEP = 60
STEP_SLEEP_S = 0.05
WAITING_SLEEP_S = 0.5  # 60 steps of it give the last of 16 workers half a minute to start
STEPS_AFTER_GROW = 5
MAX_STEPS = 5000  # a bound only: the run ends STEPS_AFTER_GROW steps after the grow
RUN_TIMEOUT_S = 600.0
FIGURES = ("recovery_s", "grow_pause_s", "decide_s")
BREAKDOWN = ("detect_s", "decide_s", "controller_s", "leave_s", "barrier_s", "connect_s", "sync_s")


def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=generator)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))


def _train_loop(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    ctx = elastic.get_context()
    model = ctx.prepare_model(make_model())
    optimizer = ctx.prepare_optimizer(make_optimizer(model))
    full, kill_step = config["world_size"], config["kill_step"]
    first_step_of: dict[int, int] = {}  # generation -> its first step, the same on each of its ranks
    for step in ctx.steps(make_dataset()):
        first_step_of.setdefault(ctx.generation, step.index)
        if step.index > kill_step and ctx.world_size == full \
                and step.index - first_step_of[ctx.generation] >= STEPS_AFTER_GROW:
            return  # grown back to full size: every rank of this generation stops at this step
        with step:
            waiting = ctx.world_size < full and step.index < kill_step
            time.sleep(WAITING_SLEEP_S if waiting else config["step_sleep_s"])
            for mb in step.micro_batches():
                mb.backward(F.mse_loss(model(mb.data[0]), mb.data[1]))
            optimizer.step()
            optimizer.zero_grad()


def run_once(world_size: int, step_sleep_s: float, storage: str) -> dict[str, Any]:
    """One run at `world_size`: kill rank 1 mid all-reduce, heal to N-1, grow back to N."""
    name = f"scale-{world_size}-{uuid.uuid4().hex[:8]}"
    trainer = elastic.ElasticTrainer(
        _train_loop,
        train_loop_config={"world_size": world_size, "kill_step": KILL_STEP, "step_sleep_s": step_sleep_s},
        scaling_config=elastic.ScalingConfig(min_workers=max(1, world_size - 1), max_workers=world_size),
        run_config=elastic.RunConfig(name=name, storage_path=storage),
        data_config=elastic.DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH,
                                       max_steps=MAX_STEPS, seed=SEED),
        faults=[elastic.Fault(kind="kill", rank=1, step=KILL_STEP, where="allreduce")],
        show_progress=False,
    )
    # fit() has no deadline of its own: past RUN_TIMEOUT_S the controller (and with it every
    # worker it owns) is killed, and fit() raises.
    watchdog = threading.Timer(RUN_TIMEOUT_S, _kill_controller, args=(name,))
    watchdog.start()
    try:
        result = trainer.fit()
    finally:
        watchdog.cancel()
    return measure(result, world_size)


def measure(result: elastic.Result, world_size: int) -> dict[str, Any]:
    """The figures of one run, from its journal (see the module docstring)."""
    injected = result.events_of("fault_injected")
    if not injected:
        raise RuntimeError(f"the fault never fired; events: {[e['type'] for e in result.events]}")
    death = injected[0]["time"]
    formed = result.events_of("generation_formed")
    before = [e for e in formed if e["time"] < death]
    if not before or before[-1]["world_size"] != world_size:
        raise RuntimeError(f"the kill at step {KILL_STEP} found {before[-1]['world_size'] if before else 0} ranks, "
                           f"not {world_size}: workers started too slowly; raise KILL_STEP")
    recovery = next((e for e in result.events_of("recovery") if e["time"] > death), None)
    if recovery is None or recovery["world_size"] != max(1, world_size - 1):
        raise RuntimeError(f"no heal to {max(1, world_size - 1)} ranks after the kill: {recovery}")
    grow = next((e for e in formed if e["kind"] == "grow" and e["time"] > recovery["time"]
                 and e["world_size"] == world_size), None)
    if grow is None:
        raise RuntimeError(f"no grow back to {world_size} ranks; generations: "
                           f"{[(e['generation'], e['kind'], e['world_size']) for e in formed]}")
    parts = {"detect_s": recovery["time"] - recovery["seconds"] - death, "controller_s": recovery["seconds"],
             **{k: recovery[k] for k in ("decide_s", "leave_s", "barrier_s", "connect_s", "sync_s")}}
    return {
        "recovery_s": recovery["time"] - death,
        "grow_pause_s": grow["pause_s"],
        "decide_s": recovery["decide_s"],
        "breakdown": parts,
        "grow": {k: grow[k] for k in ("barrier_s", "connect_s", "sync_s", "leave_s")},
        "formations": [(e["generation"], e["kind"], e["world_size"]) for e in formed],
        "aborts": sum(1 for e in result.events_of("state") if e.get("state") == "ABORTED"),
    }


def sync_bytes_per_rank(world_size: int, one_ahead: bool) -> list[int]:
    """Bytes each of `world_size` ranks sends in one heal's state sync (see the module docstring)."""
    model = make_model()
    optimizer = make_optimizer(model)
    model(torch.zeros(1, IN_FEATURES)).sum().backward()
    optimizer.step()  # creates the momentum buffers, as a running optimizer holds them
    progress = {"step": 0, "cursor": {"epoch": 0, "consumed": 0, "seed": SEED}}
    payload = {"progress": progress, "state": {"model": state_of(model), "optimizer": state_of(optimizer)}}
    structure, buffers = flatten(payload, torch.device("cpu"))
    box = [(structure, {dtype: b.numel() for dtype, b in buffers.items()})]
    broadcast = 8 + len(pickle.dumps(box)) + sum(b.numel() * b.element_size() for b in buffers.values())
    all_gather = (world_size - 1) * 16
    return [all_gather + (sends * broadcast if one_ahead else 0) for sends in _binomial_sends(world_size)]


def _binomial_sends(size: int) -> list[int]:
    """Sends of each virtual rank (0: the root) in gloo's binomial-tree broadcast."""
    sends = [0] * size
    dim = math.ceil(math.log2(size)) if size > 1 else 0
    mask = (1 << dim) - 1
    for i in range(dim):
        mask ^= 1 << i
        for vrank in range(size):
            peer = vrank ^ (1 << i)
            if vrank & mask == 0 and peer < size and vrank & (1 << i) == 0:
                sends[vrank] += 1
    return sends


def summarise(runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    scaling: dict[str, Any] = {}
    for world_size, rounds in runs.items():
        healed = max(1, world_size - 1)
        entry: dict[str, Any] = {"rounds": len(rounds), "healed_world_size": healed}
        for figure in FIGURES:
            entry[figure] = _spread([r[figure] for r in rounds])
        for key, one_ahead in (("bytes_per_rank", False), ("bytes_per_rank_one_ahead", True)):
            per_rank = sync_bytes_per_rank(healed, one_ahead)
            entry[key] = {"min": min(per_rank), "median": statistics.median(per_rank), "max": max(per_rank)}
        entry["recovery_breakdown_median"] = {k: statistics.median(r["breakdown"][k] for r in rounds) if rounds else None
                                              for k in BREAKDOWN}
        entry["grow_phases_median"] = {k: statistics.median(r["grow"][k] for r in rounds) if rounds else None
                                       for k in ("leave_s", "barrier_s", "connect_s", "sync_s")}
        entry["aborted_formations"] = [r["aborts"] for r in rounds]
        scaling[str(world_size)] = entry
    return scaling


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"min": None, "median": None, "max": None, "values": []}
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "values": values}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.simulated:
        sizes = args.sizes or (SIMULATED_QUICK_SIZES if args.quick else None)
        return scale_simulated.main(sizes, args.rounds or (1 if args.quick else None), args.out, argv)
    sizes = args.sizes or (QUICK_WORLD_SIZES if args.quick else WORLD_SIZES)
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    started = time.time()
    temp = tempfile.mkdtemp(prefix="scale-")  # short: Ray's socket paths live under it
    storage = os.path.join(temp, "runs")
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    errors: dict[str, str] = {}
    cluster = _start_cluster(os.path.join(temp, "ray"))
    try:
        # Rounds outside, sizes inside: a burst of load on the machine hits every size alike.
        for round_index in range(rounds):
            for world_size in sizes:
                label = f"N={world_size} round {round_index}"
                print(f"[scale] {label} ...", end="", flush=True)
                began = time.time()
                try:
                    run = run_once(world_size, args.step_sleep, storage)
                except Exception as exc:  # one failed run must not lose the others' figures
                    errors[label] = f"{type(exc).__name__}: {exc}"
                    print(f" FAILED: {errors[label]}", flush=True)
                    continue
                runs[world_size].append(run)
                parts = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in run["breakdown"].items())
                print(f" recovery {run['recovery_s']:.3f} s ({parts}), grow pause {run['grow_pause_s']:.3f} s; "
                      f"{time.time() - began:.0f} s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    scaling = summarise(runs)
    low, high = scaling.get("2", {}).get("recovery_s", {}), scaling.get("16", {}).get("recovery_s", {})
    ratio = high["median"] / low["median"] if low.get("median") and high.get("median") else None
    report = {
        "scaling": scaling,
        "recovery_ratio_16_vs_2": ratio,
        "setup": {"world_sizes": list(sizes), "rounds": rounds, "nodes": NODES, "cpus_per_node": CPUS_PER_NODE,
                  "model": f"MLP {IN_FEATURES}-{HIDDEN}-1, SGD momentum {MOMENTUM}", "global_batch": GLOBAL_BATCH,
                  "kill_step": KILL_STEP, "step_sleep_s": args.step_sleep, "machine_cpus": os.cpu_count()},
        "definitions": {
            "recovery_s": "death (fault_injected) to the commit of the healed generation (recovery event)",
            "grow_pause_s": "pause_s of the grow back to N: the longest pause of a running member",
            "decide_s": "the controller's first sign of the failure to the offer that committed",
            "bytes_per_rank": "bytes each rank of the healed generation sends in the state sync, computed: the "
                              "all-gather of steps alone, since no survivor was a step ahead; min/median/max over ranks",
            "bytes_per_rank_one_ahead": "the same if one survivor had committed a step more: the all-gather and the "
                                        "source's binomial-tree broadcast of the whole state",
        },
        "errors": errors,
        **_provenance(command_line("benchmarks.scale", argv), time.time() - started),
    }
    out = args.out or DEFAULT_OUT
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    _print_table(report)
    print(f"\nwrote {out}")
    return 1 if errors else 0


def _start_cluster(ray_temp: str) -> Any:
    from ray.cluster_utils import Cluster

    # Ray writes the cluster's address under its temp dir, where a plain ray.init() elsewhere
    # on this machine would find it and join: a temp dir of this run's own keeps it private.
    os.makedirs(ray_temp)
    os.environ["RAY_TMPDIR"] = ray_temp
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["OMP_NUM_THREADS"] = "1"
    # The nodes take this machine's address, not 127.0.0.1: ray.init() rewrites a loopback
    # address to the machine's, where a GCS bound to 127.0.0.1 does not answer.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(NODES):
        cluster.add_node(num_cpus=CPUS_PER_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    # Workers cannot import `benchmarks`: ship this module's train loop by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return cluster


def _kill_controller(name: str) -> None:
    try:
        ray.kill(ray.get_actor(f"elastic-controller-{name}"), no_restart=True)
    except ValueError:
        pass  # already gone


def _print_table(report: dict[str, Any]) -> None:
    print(f"\n{'N':>3}  {'recovery_s (min/med/max)':>26}  {'grow_pause_s':>22}  {'decide_s':>22}  bytes/rank max "
          "(one ahead)")
    for size, entry in report["scaling"].items():
        cells = []
        for figure in FIGURES:
            s = entry[figure]
            cells.append(f"{s['min']:.3f}/{s['median']:.3f}/{s['max']:.3f}" if s["median"] is not None else "-")
        print(f"{size:>3}  {cells[0]:>26}  {cells[1]:>22}  {cells[2]:>22}  {entry['bytes_per_rank']['max']} "
              f"({entry['bytes_per_rank_one_ahead']['max']})")
    ratio = report["recovery_ratio_16_vs_2"]
    print(f"recovery at 16 / at 2 (medians): {ratio:.2f}" if ratio else "recovery at 16 / at 2: not measured")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"world sizes {QUICK_WORLD_SIZES}, one round")
    parser.add_argument("--out", help=f"where to write the JSON (default: {DEFAULT_OUT}; with --simulated, "
                                      f"merged into {BENCH_OUT})")
    parser.add_argument("--simulated", action="store_true",
                        help=f"the pure protocol with a fake worker group at {scale_simulated.SIZES} workers, no Ray")
    parser.add_argument("--rounds", type=int, help=f"rounds (default {ROUNDS}, 1 with --quick)")
    parser.add_argument("--sizes", type=int, nargs="+", help=f"world sizes (default {WORLD_SIZES})")
    parser.add_argument("--step-sleep", type=float, default=STEP_SLEEP_S,
                        help="seconds each step sleeps before its backward, standing for compute (default %(default)s)")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds({args.rounds}) must be at least 1")
    if args.sizes and min(args.sizes) < 2:
        parser.error(f"--sizes {args.sizes}: every world size must be at least 2 (rank 1 is killed)")
    return args


if __name__ == "__main__":
    sys.exit(main())
