"""Checkpoints of a 571 MB state: the stall against a plain clone, the write against plain pyarrow writes.

    .venv/bin/python -m benchmarks.checkpoint_run                        # 3 rounds, about 5 minutes
    .venv/bin/python -m benchmarks.checkpoint_run --quick                # 1 round, under 2 minutes
    .venv/bin/python -m benchmarks.checkpoint_run --quick --out /tmp/ckpt.json
    .venv/bin/python -m benchmarks.checkpoint_run --store-stall          # a frozen store, about 2 minutes a round

Run it from the repository root. Two CPU workers train an MLP 1024 -> 4096 (x5) -> 10 with
SGD with momentum through ElasticTrainer (min_workers = max_workers = 2), one torch thread
each: 71.4M float32 parameters, so model and momentum make 571 MB, checkpointed every
EVERY_STEPS steps. Each round runs in a fresh process and Ray session, and measures:

- stall: `stall_s` of each `checkpoint_saved` event (the slowest rank's) against a plain
  clone of the same state, `{k: v.clone()}` of the model's and the optimizer's state dicts,
  timed inside each worker's train loop at the step before each checkpoint (the slower
  rank's clone);
- write: the checkpoint's bytes over the event's `upload_s` (the slowest rank's shard write,
  serialisation and sha256 included) against 2 processes writing the same shard files at
  once through pyarrow.fs.LocalFileSystem. Elastic's writer fsyncs every file on a local
  disk, so the plain writes fsync too and neither figure is the page cache's. The plain
  writes also go the way the checkpoints went: a new file each time, the newest
  `keep_last` kept, one per checkpoint interval (see `_plain_writer` for why). Beside it,
  the same writes followed by a sha256 of their bytes: the integrity check a manifest
  carries, which on a machine without a free core costs about as much as the write.

After each checkpoint the train loop sleeps QUIET_S, so that the shard writes run alone, as
they do beside an accelerator rather than beside CPU training; a round whose write outlasted
the sleep is flagged. Each figure is the median over a round's checkpoints; the JSON gets the
median over rounds under its key and min, median, max and a `disagree` flag (rounds more than
10% apart) under `spread.<key>`. The keys are merged into benchmarks/results/bench.json, or
--out, keeping the others; `produced_by` records this command, its date and commit.
Checkpoints go to a temporary folder; TMPDIR chooses the disk.

`--store-stall` measures instead what a store that stops answering costs the step: two workers
train a float64 MLP (16 -> 32 -> 1, Tanh) with a sleep of STALL_SLEEP_S after each step, a
checkpoint every STALL_EVERY steps, on a real S3-compatible server in a process of its own
(`elastic.s3_server.S3Server`, moto) reached with request_timeout=STALL_REQUEST_TIMEOUT_S. Once
step STALL_FREEZE_AT committed, the server is frozen (SIGSTOP) for STALL_FREEZE_S, then thawed.
`store_stall_60s_longest_gap_steps` is the longest gap between two steps rank 0 committed from
the freeze to STALL_AFTER_S after the thaw, in median steps of the STALL_FREEZE_AT steps before
the freeze (the goal: at most 2 plus one snapshot copy). Beside it, the steps committed while
frozen over the steps the pace before the freeze would have committed, and whether the run's
newest checkpoint after the thaw verifies.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import elastic
from elastic.checkpoint.checkpoint import file_path
from benchmarks.bench import DEFAULT_OUT, REPO_ROOT, kill_session, merge_figures

IN_FEATURES = 1024
HIDDEN = 4096
HIDDEN_LAYERS = 4  # 4096 x 4096 layers between the input and the output layer
CLASSES = 10
WORLD_SIZE = 2
GLOBAL_BATCH = 16
MICRO_BATCH = 8
NUM_SAMPLES = 256
LR = 0.01
MOMENTUM = 0.9
SEED = 0
EVERY_STEPS = 4
# Seconds the train loop sleeps after each checkpoint so its shards are written alone.
QUIET_S = 3.0
KEEP_LAST = elastic.CheckpointConfig().keep_last
ROUND_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 40
STALL_GOAL = 1.5
WRITE_GOAL = 0.8


@dataclasses.dataclass(frozen=True)
class Plan:
    rounds: int
    """Rounds, each a fresh process and Ray session; figures are spread over them."""
    checkpoints: int
    """Checkpoints per round; the run lasts checkpoints * EVERY_STEPS steps."""


FULL = Plan(rounds=3, checkpoints=4)
QUICK = Plan(rounds=1, checkpoints=3)

DEFINITIONS = {
    "checkpoint_stall_ratio_500mb": "checkpoint_500mb.stall_s / checkpoint_500mb.clone_s, per round",
    "checkpoint_write_ratio_500mb": "checkpoint_500mb.write_mb_s / checkpoint_500mb.plain_write_mb_s, per round",
    "checkpoint_500mb.stall_s": "median over a round's checkpoints of the checkpoint_saved event's stall_s (the "
                                "slowest rank's time with training blocked)",
    "checkpoint_500mb.clone_s": "median over a round's checkpoints of the slower rank's {k: v.clone()} of its model's "
                                "and optimizer's state tensors, timed in the train loop at the step before",
    "checkpoint_500mb.write_mb_s": "median over a round's checkpoints of the checkpoint's bytes / the event's upload_s "
                                   "(the slowest rank's serialisation, sha256, write and fsync of its shard)",
    "checkpoint_500mb.plain_write_mb_s": "the same shard files written again by 2 processes at once through "
                                         "pyarrow.fs.LocalFileSystem and fsynced, each time to new files (the newest "
                                         "keep_last kept) one checkpoint interval apart: bytes / the slower process's "
                                         "time; median over as many writes as the round had checkpoints",
    "checkpoint_500mb.plain_write_hashed_mb_s": "as plain_write_mb_s, each process also taking the sha256 of its "
                                                "bytes after the write",
    "checkpoint_500mb.write_ratio_vs_hashed_plain": "write_mb_s / plain_write_hashed_mb_s, per round",
}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.measure_round:
        result = _measure_round(args.measure_round, args.checkpoints)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0
    if args.store_stall:
        return _store_stall(args, argv)
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    started = time.time()
    log_dir = tempfile.mkdtemp(prefix="ckpt-bench-logs-")
    rounds: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for index in range(plan.rounds):
        label = f"round{index}"
        storage = tempfile.mkdtemp(prefix="ckpt-bench-")
        try:
            outcome = _run_round(label, storage, plan.checkpoints, log_dir)
            if "error" in outcome:
                errors[label] = outcome["error"]
                continue
            outcome["plain"] = _plain_writes(outcome["shards"], storage, len(outcome["checkpoints"]),
                                             _interval_s(outcome["checkpoints"]))
            rounds.append(_round_figures(outcome))
        finally:
            shutil.rmtree(storage, ignore_errors=True)
    figures = {key: [r["figures"][key] for r in rounds] for key in DEFINITIONS}
    details = {"checkpoint_500mb": {
        "state_bytes": state_bytes(),
        "world_size": WORLD_SIZE,
        "model": f"MLP {IN_FEATURES} -> {HIDDEN} (x{HIDDEN_LAYERS + 1}) -> {CLASSES}, float32",
        "optimizer": f"SGD(lr={LR}, momentum={MOMENTUM})",
        "every_steps": EVERY_STEPS,
        "checkpoints_per_round": plan.checkpoints,
        "quiet_s": QUIET_S,
        "fsync": "elastic's writer and the plain writes both fsync every file",
        "goals": {"stall_ratio_at_most": STALL_GOAL, "write_ratio_at_least": WRITE_GOAL},
        "rounds": rounds,
        "errors": errors,
    }}
    report = merge_figures(args.out, figures, details, DEFINITIONS, _command(argv), time.time() - started)
    _print_table(report)
    print(f"\nwrote {args.out}")
    if errors:
        print(f"{len(errors)} round(s) failed: {', '.join(errors)}; logs in {log_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of 3 checkpoints; about 2 minutes")
    parser.add_argument("--store-stall", action="store_true",
                        help="measure a store frozen for 60 s instead (1 round unless --rounds)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON to merge the figures into (default: %(default)s)")
    parser.add_argument("--rounds", type=int, help="rounds (overrides the preset)")
    # Internal: the parent re-runs this module with these to train one round in a fresh process.
    parser.add_argument("--measure-round", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds({args.rounds}) must be at least 1")
    return args


def _command(argv: list[str] | None) -> str:
    given = sys.argv[1:] if argv is None else argv
    return shlex.join([os.path.relpath(sys.executable, REPO_ROOT), "-m", "benchmarks.checkpoint_run", *given])


# --- the workload ------------------------------------------------------------------------
def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU()]
    for _ in range(HIDDEN_LAYERS):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(HIDDEN, CLASSES))
    return torch.nn.Sequential(*layers)


def state_bytes() -> int:
    """Bytes of the model's parameters and their momentum buffers."""
    parameters = sum(p.numel() * p.element_size() for p in make_model().parameters())
    return 2 * parameters


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (NUM_SAMPLES,), generator=generator)
    return TensorDataset(inputs, labels)


def _train_loop(config: dict[str, Any]) -> None:
    """Train; time a plain clone of the state at the step before each checkpoint, and sleep
    at the step after it. Each rank writes its clone times to `clone_dir`."""
    torch.set_num_threads(1)
    ctx = elastic.get_context()
    module = make_model()
    model = ctx.prepare_model(module)
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM))
    clones = []
    for step in ctx.steps(make_dataset()):
        if step.index % EVERY_STEPS == EVERY_STEPS - 1:
            clones.append(_time_clone(module, optimizer))
        elif step.index and step.index % EVERY_STEPS == 0:
            time.sleep(QUIET_S)  # the checkpoint of the boundary just passed is being written
        with step:
            for mb in step.micro_batches():
                mb.backward(F.cross_entropy(model(mb.data[0]), mb.data[1]))
            optimizer.step()
            optimizer.zero_grad()
    with open(os.path.join(config["clone_dir"], f"rank-{ctx.rank}.json"), "w") as f:
        json.dump(clones, f)


def _time_clone(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Seconds to clone every tensor of the model's and the optimizer's state dicts."""
    began = time.perf_counter()
    model_copy = {k: v.clone() for k, v in module.state_dict().items()}
    optimizer_copy = [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                      for s in optimizer.state_dict()["state"].values()]
    took = time.perf_counter() - began
    del model_copy, optimizer_copy
    return took


# --- one round: the elastic run in a subprocess, then the plain writes ---------------------
def _run_round(label: str, storage: str, checkpoints: int, log_dir: str) -> dict[str, Any]:
    """Train one round in a fresh interpreter; its result, or {"error": ...} if it failed."""
    result_path = os.path.join(log_dir, f"{label}.json")
    log_path = os.path.join(log_dir, f"{label}.log")
    env = dict(os.environ)
    # Ray's worker processes inherit the environment, so they can import `benchmarks` too.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    command = [sys.executable, "-m", "benchmarks.checkpoint_run", "--measure-round", storage,
               "--checkpoints", str(checkpoints), "--result", result_path]
    print(f"[checkpoint] {label} ...", end="", flush=True)
    began = time.time()
    with open(log_path, "w") as log:
        # A session of its own, so that a timeout also ends the Ray processes the child started.
        child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            code = child.wait(timeout=ROUND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_session(child.pid)
            child.wait()
            code = None
    if code == 0 and os.path.exists(result_path):
        print(f" {time.time() - began:.0f} s", flush=True)
        with open(result_path) as f:
            return json.load(f)
    why = f"timed out after {ROUND_TIMEOUT_S:.0f} s" if code is None else f"exited with code {code}"
    with open(log_path) as f:
        tail = "".join(f.readlines()[-LOG_TAIL_LINES:])
    print(f" FAILED ({why}); last lines of {log_path}:\n{tail}", flush=True)
    return {"error": f"{why}; log: {log_path}"}


def _measure_round(storage: str, checkpoints: int) -> dict[str, Any]:
    """The elastic run of one round (in the subprocess): its checkpoint events, clone times and shard files."""
    import ray

    clone_dir = tempfile.mkdtemp(prefix="clones-", dir=storage)
    trainer = elastic.ElasticTrainer(
        _train_loop,
        train_loop_config={"clone_dir": clone_dir},
        scaling_config=elastic.ScalingConfig(min_workers=WORLD_SIZE, max_workers=WORLD_SIZE),
        run_config=elastic.RunConfig(name=f"ckpt-{uuid.uuid4().hex[:8]}", storage_path=storage,
                                     checkpoint_config=elastic.CheckpointConfig(every_steps=EVERY_STEPS)),
        data_config=elastic.DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                                       max_steps=checkpoints * EVERY_STEPS, seed=SEED),
        show_progress=False,
    )
    # "local" starts a fresh instance even when a cluster from `ray start` runs on this machine.
    ray.init(address="local")
    try:
        result = trainer.fit()
    finally:
        ray.shutdown()
    clones = []
    for rank in range(WORLD_SIZE):
        with open(os.path.join(clone_dir, f"rank-{rank}.json")) as f:
            clones.append(json.load(f))
    saved = result.events_of("checkpoint_saved")
    shards = [f for f in result.checkpoint.manifest["files"] if f["name"].startswith("shard-")]
    return {
        "checkpoints": [{k: e[k] for k in ("step", "time", "bytes", "stall_s", "upload_s")} for e in saved],
        "clone_s": clones,
        "shards": [os.path.join(result.checkpoint.path, file_path(f)) for f in shards],
        "shard_bytes": sum(f["size"] for f in shards),
    }


def _plain_writes(shards: list[str], folder: str, repeats: int, interval_s: float) -> dict[str, list[float]]:
    """Seconds to write `shards` again, one process per shard, all at once, `repeats` times:
    each repeat's slowest process, for the write alone ("plain") and with the sha256 after it
    ("plain_hashed")."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(shards))
    results = context.Queue()
    writers = [context.Process(target=_plain_writer, args=(shard, folder, repeats, interval_s, barrier, results))
               for shard in shards]
    for writer in writers:
        writer.start()
    per_process = [results.get(timeout=ROUND_TIMEOUT_S) for _ in writers]
    for writer in writers:
        writer.join()
    return {way: [max(times[way][i] for times in per_process) for i in range(repeats)]
            for way in ("plain", "plain_hashed")}


def _plain_writer(shard: str, folder: str, repeats: int, interval_s: float, barrier: Any, results: Any) -> None:
    """One process: write a shard file's bytes anew the way the checkpoints were written.

    Each repeat is a new file, fsynced, and only the newest KEEP_LAST stay, `interval_s`
    apart: on a VM that hands freed memory back to its host, page cache that grows into
    fresh memory costs several times what reused page cache costs, so a plain write that
    overwrote one file back to back would be measured in easier conditions than the run's.
    """
    with open(shard, "rb") as f:
        data = f.read()
    fs = pafs.LocalFileSystem()
    times: dict[str, list[float]] = {"plain": [], "plain_hashed": []}
    written = []
    for repeat in range(repeats):
        path = os.path.join(folder, f"plain-{repeat}-{os.path.basename(shard)}")
        barrier.wait()
        began = time.perf_counter()
        with fs.open_output_stream(path) as out:
            out.write(data)
        descriptor = os.open(path, os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)
        times["plain"].append(time.perf_counter() - began)
        hashlib.sha256(data).hexdigest()
        times["plain_hashed"].append(time.perf_counter() - began)
        written.append(path)
        for old in written[:-KEEP_LAST]:
            os.remove(old)
        written = written[-KEEP_LAST:]
        time.sleep(interval_s)
    results.put(times)


def _interval_s(saved: list[dict[str, Any]]) -> float:
    """Median seconds between consecutive checkpoints of the run."""
    gaps = [b["time"] - a["time"] for a, b in zip(saved, saved[1:])]
    return statistics.median(gaps) if gaps else QUIET_S


def _round_figures(outcome: dict[str, Any]) -> dict[str, Any]:
    """One round's figures, and what they came from."""
    saved = outcome["checkpoints"]
    total = outcome["shard_bytes"]
    stall_s = statistics.median(e["stall_s"] for e in saved)
    clone_s = statistics.median(max(per_rank) for per_rank in zip(*outcome["clone_s"]))
    write_mb_s = statistics.median(e["bytes"] / 1e6 / e["upload_s"] for e in saved)
    plain_mb_s = statistics.median(total / 1e6 / s for s in outcome["plain"]["plain"])
    hashed_mb_s = statistics.median(total / 1e6 / s for s in outcome["plain"]["plain_hashed"])
    return {
        "figures": {
            "checkpoint_stall_ratio_500mb": stall_s / clone_s,
            "checkpoint_write_ratio_500mb": write_mb_s / plain_mb_s,
            "checkpoint_500mb.stall_s": stall_s,
            "checkpoint_500mb.clone_s": clone_s,
            "checkpoint_500mb.write_mb_s": write_mb_s,
            "checkpoint_500mb.plain_write_mb_s": plain_mb_s,
            "checkpoint_500mb.plain_write_hashed_mb_s": hashed_mb_s,
            "checkpoint_500mb.write_ratio_vs_hashed_plain": write_mb_s / hashed_mb_s,
        },
        "shard_bytes": total,
        "checkpoints": saved,
        "clone_s": outcome["clone_s"],
        "plain_write_s": outcome["plain"],
        # The write ran beside training, not alone: its figure is not the writer's own.
        "write_outlasted_quiet_s": any(e["upload_s"] >= QUIET_S for e in saved),
    }


def _print_table(report: dict[str, Any]) -> None:
    spreads = report["spread"]
    rows = [("stall / plain clone (on the worker)", "checkpoint_stall_ratio_500mb", f"<= {STALL_GOAL}"),
            ("write / plain pyarrow write, both fsynced", "checkpoint_write_ratio_500mb", f">= {WRITE_GOAL}"),
            ("write / plain write + sha256", "checkpoint_500mb.write_ratio_vs_hashed_plain", ""),
            ("stall s", "checkpoint_500mb.stall_s", ""),
            ("plain clone s", "checkpoint_500mb.clone_s", ""),
            ("write MB/s", "checkpoint_500mb.write_mb_s", ""),
            ("plain write MB/s", "checkpoint_500mb.plain_write_mb_s", ""),
            ("plain write + sha256 MB/s", "checkpoint_500mb.plain_write_hashed_mb_s", "")]
    print(f"\ncheckpoints of {state_bytes() / 1e6:.0f} MB at world size {WORLD_SIZE}")
    print(f"{'':<44}{'min':>9}{'median':>9}{'max':>9}  goal")
    for label, key, goal in rows:
        spread = spreads.get(key)
        if spread is None:
            print(f"{label:<44}{'-':>9}{'-':>9}{'-':>9}  {goal}")
            continue
        flag = "  rounds disagree by >10%" if spread["disagree"] else ""
        print(f"{label:<44}{spread['min']:>9.3f}{spread['median']:>9.3f}{spread['max']:>9.3f}  {goal}{flag}")
    outlasted = [i for i, r in enumerate(report["checkpoint_500mb"]["rounds"]) if r["write_outlasted_quiet_s"]]
    if outlasted:
        print(f"rounds {outlasted}: a shard write outlasted the {QUIET_S} s pause and overlapped training")



# --- a store that stops answering -----------------------------------------------------------
STALL_FREEZE_S = 60.0
STALL_FREEZE_AT = 40
STALL_SLEEP_S = 0.05
STALL_EVERY = 10
STALL_REQUEST_TIMEOUT_S = 5.0
STALL_AFTER_S = 10.0  # how long after the thaw the gaps still count: the writes that failed end then
STALL_SAMPLES = 256

STALL_DEFINITIONS = {
    "store_stall_60s_longest_gap_steps": "the longest gap between two steps rank 0 committed, from the freeze of the "
                                         "checkpoint store to STALL_AFTER_S after its thaw, over the median gap of "
                                         "the STALL_FREEZE_AT steps before the freeze",
    "store_stall_60s.steps_while_frozen_ratio": "steps committed while the store was frozen / the steps the pace "
                                                "before the freeze would have committed in that time",
    "store_stall_60s.median_step_s": "the median gap between two committed steps before the freeze",
    "store_stall_60s.newest_checkpoint_verifies": "1 if the run's newest checkpoint, written after the thaw, "
                                                  "verifies (every listed file present, sized and hashed right)",
}


def _stall_loop(config: dict[str, Any]) -> None:
    ctx = elastic.get_context()
    torch.manual_seed(SEED)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
    model = ctx.prepare_model(module)
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(module.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(STALL_SAMPLES, 16, generator=generator, dtype=torch.float64)
    dataset = TensorDataset(x, torch.tanh(x[:, :4].sum(1, keepdim=True)))
    for step in ctx.steps(dataset):
        with step:
            for mb in step.micro_batches():
                mb.backward(F.mse_loss(model(mb.data[0]), mb.data[1]))
            optimizer.step()
            optimizer.zero_grad()
        if ctx.rank == 0:
            with open(config["step_log"], "a") as log:
                log.write(f"{step.index} {time.time()}\n")
        time.sleep(STALL_SLEEP_S)


def _store_stall_round(freeze_s: float, folder: str) -> dict[str, Any]:
    import ray

    from elastic.checkpoint.checkpoint import checkpoint_storage, verify
    from elastic.checkpoint.storage import RunStorage
    from elastic.s3_server import S3Server

    log = os.path.join(folder, "steps.log")
    max_steps = STALL_FREEZE_AT + int((freeze_s + 2 * STALL_AFTER_S) / STALL_SLEEP_S)
    with S3Server() as server:
        fs = server.filesystem(connect_timeout=1, request_timeout=STALL_REQUEST_TIMEOUT_S)
        server.filesystem(allow_bucket_creation=True).create_dir("bucket")

        def committed() -> list[tuple[int, float]]:
            if not os.path.exists(log):
                return []
            with open(log) as f:
                return [(int(a), float(b)) for a, b in (line.split() for line in f.read().splitlines())]

        freeze = server.freeze_when(lambda: len(committed()) >= STALL_FREEZE_AT, freeze_s)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", num_cpus=WORLD_SIZE, include_dashboard=False, log_to_driver=False)
        try:
            result = elastic.ElasticTrainer(
                _stall_loop, train_loop_config={"step_log": log},
                scaling_config=elastic.ScalingConfig(num_workers=WORLD_SIZE),
                run_config=elastic.RunConfig(name="store-stall", storage_path="bucket/runs", storage_filesystem=fs,
                                             checkpoint_config=elastic.CheckpointConfig(every_steps=STALL_EVERY)),
                data_config=elastic.DataConfig(global_batch_size=32, micro_batch_size=16, max_steps=max_steps),
                show_progress=False,
            ).fit()
        finally:
            ray.shutdown()
        freeze.join()
        window = {"frozen": freeze.frozen, "thawed": freeze.thawed}
        stamps = committed()
        before = [t for s, t in stamps if s < STALL_FREEZE_AT]
        median_step = statistics.median(b - a for a, b in zip(before, before[1:]))
        counted = [t for _, t in stamps if window["frozen"] <= t <= window["thawed"] + STALL_AFTER_S]
        edges = [max(t for _, t in stamps if t < window["frozen"]), *counted]
        longest = max(b - a for a, b in zip(edges, edges[1:]))
        while_frozen = sum(window["frozen"] < t < window["thawed"] for _, t in stamps)
        newest = result.checkpoint
        verified = newest is not None and newest.step > max(s for s, t in stamps if t < window["thawed"])
        if verified:
            verify(checkpoint_storage(RunStorage("bucket/runs", "store-stall", fs), newest.step))
        return {"figures": {
            "store_stall_60s_longest_gap_steps": longest / median_step,
            "store_stall_60s.steps_while_frozen_ratio": while_frozen / (freeze_s / median_step),
            "store_stall_60s.median_step_s": median_step,
            "store_stall_60s.newest_checkpoint_verifies": float(verified),
        }, "skipped": len(result.events_of("checkpoint_skipped")), "saved": len(result.events_of("checkpoint_saved"))}


def _store_stall(args: argparse.Namespace, argv: list[str] | None) -> int:
    started = time.time()
    rounds = []
    for index in range(args.rounds or 1):
        folder = tempfile.mkdtemp(prefix="store-stall-")
        print(f"[store stall] round {index} ...", flush=True)
        try:
            rounds.append(_store_stall_round(STALL_FREEZE_S, folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    figures = {key: [r["figures"][key] for r in rounds] for key in STALL_DEFINITIONS}
    details = {"store_stall_60s": {
        "freeze_s": STALL_FREEZE_S, "freeze_at_step": STALL_FREEZE_AT, "sleep_s": STALL_SLEEP_S,
        "every_steps": STALL_EVERY, "request_timeout_s": STALL_REQUEST_TIMEOUT_S, "after_s": STALL_AFTER_S,
        "world_size": WORLD_SIZE, "store": "moto_server in its own process, frozen with SIGSTOP",
        "rounds": rounds,
    }}
    merge_figures(args.out, figures, details, STALL_DEFINITIONS, _command(argv), time.time() - started)
    for key, values in figures.items():
        print(f"{key:48s} {statistics.median(values):.3g}  ({', '.join(f'{v:.3g}' for v in values)})")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
