"""Train loops shared by the integration tests.

`regression_loop` trains a float64 MLP on a fixed regression set and keeps a per-sample ledger
as synced state: each committed step all-reduces the count of every sample its ranks
processed and adds it to the row of the step's epoch. At the first step of every generation
it checks that all ranks hold bit-identical synced state (model, optimizer, ledger and the
technique's; under EASGD, a model equal to the center), and raises if not, which fails the
run. With `check_collectives` it checks every collective of `ctx.collectives` against the
answer it computes from the world size;
with `inf_at=(rank, step)` that rank's loss is inf at that step, and it checks that every
rank skipped the step (fp16 loss scaling). Under local SGD it checks after every sync that
the model and the outer state are the same on every rank; under EASGD, whose ranks keep their
own parameters between syncs, the center after every sync and the model after the last.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import torch
import torch.distributed as dist

import elastic
from elastic.checkpoint.checkpoint import latest_complete
from elastic.checkpoint.storage import RunStorage
from elastic.journal.events import read_events

NUM_SAMPLES = 512
GLOBAL_BATCH = 64
STEPS_PER_EPOCH = NUM_SAMPLES // GLOBAL_BATCH


def regression_data(num_samples: int = NUM_SAMPLES, dtype: torch.dtype = torch.float64) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, 16, generator=generator, dtype=torch.float64)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * x[:, 4:5]
    return torch.utils.data.TensorDataset(x.to(dtype), y.to(dtype))


def build_mlp(hidden: int = 32, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)).to(dtype)


def state_digest(*objects) -> str:
    digest = hashlib.sha256()
    for obj in objects:
        state = obj.state_dict() if hasattr(obj, "state_dict") else {"t": obj}
        for tensor in _tensors(state):
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (int, float)):
        yield torch.tensor(float(value), dtype=torch.float64)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def regression_loop(config: dict) -> dict:
    ctx = elastic.get_context()
    dtype = getattr(torch, config.get("dtype", "float64"))
    dataset = regression_data(config.get("num_samples", NUM_SAMPLES), dtype)
    model = ctx.prepare_model(build_mlp(config.get("hidden", 32), dtype))
    optimizer = regression_optimizer(model.parameters(), config)
    if config.get("prepare_optimizer", True):
        optimizer = ctx.prepare_optimizer(optimizer)
    epochs = -(-config["max_steps"] // STEPS_PER_EPOCH)
    ledger = torch.zeros(epochs, NUM_SAMPLES, dtype=torch.float64)
    ctx.register_state("ledger", ledger)
    checked: list[int] = []
    collectives_checked: set[int] = set()
    skipped: list[int] = []
    sync_every, synced_at = ctx.strategy.sync_options.get("every"), []
    for step in ctx.steps(dataset):
        with step:
            if config.get("check_collectives"):
                collectives_checked.add(check_collectives(ctx.collectives, ctx.rank))
            if sync_every and step.index and step.index % sync_every == 0:
                # Decided by the step index alone: every rank calls it.
                check_synced(ctx, synced_at, model_alike=ctx.strategy.sync_options["kind"] != "easgd")
            check_alike_when_formed(ctx, checked)
            time.sleep(config.get("compute_s", 0.0))  # a slow step's compute, inside the step
            if step.index == config.get("stand_still", (-1, 0))[0]:
                time.sleep(config["stand_still"][1])  # every rank inside one step: the run stands still
            if step.index == config.get("mismatch_at"):
                dist.all_reduce(torch.ones(1 + ctx.rank))  # a user bug: shapes differ across ranks
            overflow = tuple(config.get("inf_at", ())) == (ctx.rank, step.index)
            before = [p.detach().clone() for p in model.parameters()]
            counts = torch.zeros(NUM_SAMPLES, dtype=torch.float64)
            for mb in step.micro_batches():
                x, y = mb.data
                counts[mb.indices] += 1
                loss = torch.nn.functional.mse_loss(model(x), y)
                mb.backward(loss * float("inf") if overflow else loss)
            counts = counts.to(ctx.device)  # NCCL sums device tensors only
            dist.all_reduce(counts)
            raise_inside(config, ctx.rank, step.index)
            optimizer.step()
            optimizer.zero_grad()
            unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
            if config.get("inf_at") and unchanged:
                skipped.append(step.index)
            if config.get("inf_at") and step.index == config["inf_at"][1]:
                agreed = [None] * ctx.world_size
                dist.all_gather_object(agreed, unchanged)
                if agreed != [True] * ctx.world_size:
                    raise AssertionError(f"step {step.index} with an inf loss was skipped by ranks {agreed} only")
            ledger[step.cursor.epoch] += counts.cpu()

        bad_rank, bad_step = config.get("raise_from", (-1, 0))
        if ctx.rank == bad_rank and step.index >= bad_step:
            raise ValueError(f"injected user error on rank {ctx.rank} at step {step.index}")
        elastic.report({"loss": loss.item()})
        if config.get("step_log") and ctx.rank == 0:
            with open(config["step_log"], "a") as log:  # when each step committed, for benchmarks/partition.py
                log.write(f"{step.index} {time.time()}\n")
        time.sleep(config.get("sleep_s", 0.0))
        hold_at_gate(config, step.index)
        hold_for_checkpoint(config, step.index)
    if sync_every:
        check_synced(ctx, synced_at)  # the run's last step ends with a sync
    with torch.no_grad():
        x, y = dataset.tensors
        final_loss = torch.nn.functional.mse_loss(model.module(x.to(ctx.device)), y.to(ctx.device)).item()
    return {
        "params": ctx.model_state_dict(),  # whole in any layout: ZeRO-3's shards gathered on every rank
        "ledger": ledger.clone(),
        "checked": checked,
        "pid": os.getpid(),
        "final_loss": final_loss,
        "comm_bytes": ctx.communication["sync_bytes"],
        "outer_syncs": ctx.communication["outer_syncs"],
        "hierarchical_all_reduces": ctx.communication["hierarchical_all_reduces"],
        "collectives_checked": sorted(collectives_checked),
        "skipped": skipped,
        "synced_at": synced_at,
    }


def build_pipeline_mlp(dtype: torch.dtype = torch.float64) -> torch.nn.Sequential:
    """Five layers, cut by 2 pipeline stages into (Linear, Tanh, Linear) and (Tanh, Linear)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1)).to(dtype)


def build_3d_mlp(dtype: torch.dtype = torch.float64) -> torch.nn.Sequential:
    """Two Linear pairs, cut by 2 pipeline stages into one pair each, which tensor parallelism cuts
    (colwise, then rowwise: `PLAN_3D`), so each stage hands the next a whole activation."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(dtype)


def pipeline_loop(config: dict) -> dict:
    """`regression_loop`'s task in a pipelined run: each replica pipelines its share through its
    stages, with the same per-sample ledger (counted by each replica's first worker) and AdamW.
    With pipeline stages and tensor parallelism both, the model is `build_3d_mlp`'s."""
    from elastic.parallel.tensor_parallel import mlp_plan

    ctx = elastic.get_context()
    dataset = regression_data()
    if ctx.shape.tensor_parallel > 1:
        model = ctx.prepare_model(build_3d_mlp(), loss_fn=torch.nn.functional.mse_loss,
                                  tensor_parallel_plan={**mlp_plan("0", "2"), **mlp_plan("4", "6")})
    else:
        model = ctx.prepare_model(build_pipeline_mlp(), loss_fn=torch.nn.functional.mse_loss)
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    ledger = torch.zeros(-(-config["max_steps"] // STEPS_PER_EPOCH), NUM_SAMPLES, dtype=torch.float64)
    ctx.register_state("ledger", ledger)
    losses = {}
    for step in ctx.steps(dataset):
        with step:
            time.sleep(config.get("compute_s", 0.0))
            batch = step.batch()
            counts = torch.zeros(NUM_SAMPLES, dtype=torch.float64)
            if ctx.pipeline_stage == 0 and ctx.tensor_parallel_rank == 0:
                counts[batch.indices] += 1
            # Every replica's stage 0 counted its share. Before model.step: a collective of every
            # rank between the stages' gradient averages and the optimizer's step would hide a
            # stage that steps while another's average failed.
            dist.all_reduce(counts)
            loss = model.step(batch)
            optimizer.step()
            optimizer.zero_grad()
            ledger[step.cursor.epoch] += counts.cpu()
        if loss is not None:
            losses[step.index] = loss.item()
            elastic.report({"loss": loss.item()})
        hold_at_gate(config, step.index)
    return {"ledger": ledger.clone(), "stage": ctx.pipeline_stage, "losses": losses, "model": ctx.model_state_dict()}


def build_tensor_parallel_mlp(dtype: torch.dtype = torch.float64) -> torch.nn.Sequential:
    """A Linear pair that tensor parallelism cuts (colwise, then rowwise), and a plain head every rank holds whole."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).to(dtype)


def tensor_parallel_loop(config: dict) -> dict:
    """`pipeline_loop`'s task in a tensor-parallel run: `build_tensor_parallel_mlp`'s Linear pair cut
    Megatron's way across each replica's 2 workers, the head whole on both, the ledger counted by
    tensor-parallel rank 0 of each replica."""
    from elastic.parallel.tensor_parallel import mlp_plan

    ctx = elastic.get_context()
    dataset = regression_data()
    model = ctx.prepare_model(build_tensor_parallel_mlp(), tensor_parallel_plan=mlp_plan("0", "2"))
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    ledger = torch.zeros(-(-config["max_steps"] // STEPS_PER_EPOCH), NUM_SAMPLES, dtype=torch.float64)
    ctx.register_state("ledger", ledger)
    for step in ctx.steps(dataset):
        with step:
            time.sleep(config.get("compute_s", 0.0))
            counts = torch.zeros(NUM_SAMPLES, dtype=torch.float64)
            for mb in step.micro_batches():
                x, y = mb.data
                if ctx.tensor_parallel_rank == 0:
                    counts[mb.indices] += 1
                loss = torch.nn.functional.mse_loss(model(x), y)
                mb.backward(loss)
            dist.all_reduce(counts)  # before the optimizer's step, which averages the slices across replicas
            optimizer.step()
            optimizer.zero_grad()
            ledger[step.cursor.epoch] += counts.cpu()
        hold_at_gate(config, step.index)
    return {"ledger": ledger.clone(), "model": ctx.model_state_dict()}


def plain_reference(max_steps: int, global_batch: int = GLOBAL_BATCH, build=None, optimizer=None, seed: int = 0,
                    dtype: torch.dtype = torch.float64, stale: int | None = None) -> dict[str, torch.Tensor]:
    """The model (`build()`, by default `pipeline_loop`'s) trained by one process on each step's
    whole global batch, in the run's sample order (elastic's own loader at world size 1, with the
    run's data seed), by `optimizer(parameters)` (by default `pipeline_loop`'s AdamW). The same
    math at any world size makes it every fault-free and faulty run's reference, at no Ray cost.
    With `stale` = S, stale synchrony's: each step applies the gradient of S steps before, none in
    the first S, and the last step every one left."""
    from elastic.config import DataConfig
    from elastic.data.loader import Loader
    from elastic.data.order import DataCursor

    dataset = regression_data(dtype=dtype)
    loader = Loader(dataset, DataConfig(global_batch_size=global_batch, micro_batch_size=global_batch,
                                        max_steps=max_steps, seed=seed))
    model = (build or build_pipeline_mlp)()
    optimizer = (optimizer or (lambda parameters: torch.optim.AdamW(parameters, lr=0.01)))(model.parameters())
    cursor = DataCursor(seed=seed)
    params, late = list(model.parameters()), []
    for step in range(max_steps):
        (loaded,) = loader.step(cursor, 1, 0)
        x, y = loaded.data
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if stale is None:
            optimizer.step()
        else:
            late.append([p.grad.clone() for p in params])
            due = late[:max(0, len(late) - stale)] if step < max_steps - 1 else late
            late = late[len(due):]
            for gradients in due:
                for p, g in zip(params, gradients):
                    p.grad = g
                optimizer.step()
        cursor = loader.advance(cursor)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def regression_optimizer(parameters, config: dict) -> torch.optim.Optimizer:
    """`regression_loop`'s optimizer for its config: AdamW, or SGD with its lr and momentum."""
    if config.get("optimizer") == "adamw":
        return torch.optim.AdamW(parameters, lr=0.01)
    return torch.optim.SGD(parameters, lr=config.get("lr", 0.05), momentum=config.get("momentum", 0.9))


def regression_reference(max_steps: int, seed: int, global_batch: int = GLOBAL_BATCH, **config) -> dict:
    """What `regression_loop` returns for a fault-free run of its `config` (hidden, dtype,
    optimizer, lr, momentum, stale: the bound of `Strategy(sync="stale:bound=S")`) and data seed ("params" and "final_loss"), computed by one process
    (`plain_reference`)."""
    torch_dtype = getattr(torch, config.get("dtype", "float64"))
    hidden = config.get("hidden", 32)
    params = plain_reference(max_steps, global_batch, lambda: build_mlp(hidden, torch_dtype),
                             lambda parameters: regression_optimizer(parameters, config), seed, torch_dtype,
                             config.get("stale"))
    model = build_mlp(hidden, torch_dtype)
    model.load_state_dict(params)
    with torch.no_grad():
        x, y = regression_data(dtype=torch_dtype).tensors
        final_loss = torch.nn.functional.mse_loss(model(x), y).item()
    return {"params": params, "final_loss": final_loss}


def write_regression_parquet(folder: str, num_samples: int, files: int, filesystem=None, row_group_size: int = 16) -> None:
    """`regression_data` as Parquet: `files` files of row groups of `row_group_size` rows, with
    columns x (16 float64) and y (float64), sample i in row i of the files in name order."""
    x, y = regression_data(num_samples).tensors
    fs = filesystem or pafs.LocalFileSystem()
    fs.create_dir(folder, recursive=True)
    bounds = [num_samples * f // files for f in range(files + 1)]
    for f, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        table = pa.table({"x": pa.array(x[start:stop].tolist(), pa.list_(pa.float64(), 16)),
                          "y": pa.array(y[start:stop, 0].tolist(), pa.float64())})
        with fs.open_output_stream(f"{folder}/part-{f:03d}.parquet") as out:
            pq.write_table(table, out, row_group_size=row_group_size)


class RegressionStream(torch.utils.data.IterableDataset):
    """`regression_data` as a stream that saves its position (torchdata's Stateful protocol):
    yields {"x", "y"} rows in order."""

    def __init__(self, num_samples: int) -> None:
        self.x, self.y = regression_data(num_samples).tensors
        self.position = 0

    def __iter__(self):
        while self.position < len(self.x):
            self.position += 1
            yield {"x": self.x[self.position - 1], "y": self.y[self.position - 1, 0]}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def streaming_loop(config: dict) -> dict:
    """Streams `config["source"]` (Parquet from `write_regression_parquet`) through
    elastic.ParquetDataset, with an LR scheduler registered as state, and draws from the torch,
    python and numpy generators every step into the loss, so the run equals a fault-free one
    only if the RNG states and the scheduler travel with every heal and grow. Keeps a
    per-sample ledger and checks that the synced state (RNG included) is identical on every
    rank when each generation starts."""
    ctx = elastic.get_context()
    random.seed(0)
    numpy.random.seed(0)
    if config.get("iterable"):
        dataset = RegressionStream(config["num_samples"])
    else:
        dataset = elastic.ParquetDataset(config["source"], filesystem=config.get("filesystem"), cache_rows=64)
    model = ctx.prepare_model(build_mlp())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    ctx.register_state("scheduler", scheduler)
    ledger = torch.zeros(config["epochs"], config["num_samples"], dtype=torch.float64)
    ctx.register_state("ledger", ledger)
    checked: list[int] = []
    for step in ctx.steps(dataset):
        with step:
            check_alike_when_formed(ctx, checked)
            scale = 1 + 0.1 * (torch.rand(()).item() + random.random() + float(numpy.random.rand()))
            counts = torch.zeros(config["num_samples"], dtype=torch.float64)
            for mb in step.micro_batches():
                counts[mb.indices] += 1
                loss = torch.nn.functional.mse_loss(model(mb.data["x"]).squeeze(1), mb.data["y"])
                mb.backward(loss * scale)
            counts = counts.to(ctx.device)  # NCCL sums device tensors only
            dist.all_reduce(counts)
            raise_inside(config, ctx.rank, step.index)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            ledger[step.cursor.epoch] += counts.cpu()
        time.sleep(config.get("sleep_s", 0.0))
        hold_at_gate(config, step.index)
    return {
        "params": {k: v.clone() for k, v in model.module.state_dict().items()},
        "ledger": ledger.clone(),
        "checked": checked,
        "scheduler_steps": scheduler.last_epoch,
        "lr": optimizer.param_groups[0]["lr"],
    }


def raise_inside(config: dict, rank: int, step_index: int) -> None:
    """The user's own error inside `with step`, after the backward: `raise_inside` is (rank, step,
    message, marker), raised at every attempt of that step, or only at the first where `marker`
    names a file (made when it is raised)."""
    if "raise_inside" not in config:
        return
    bad_rank, bad_step, message, marker = config["raise_inside"]
    if (rank, step_index) != (bad_rank, bad_step) or (marker and os.path.exists(marker)):
        return
    if marker:
        open(marker, "w").close()
    raise RuntimeError(message)


def hold_at_gate(config: dict, step_index: int) -> None:
    """Hold the train loop after step `gate[0]` until the file `gate[1]` exists, for the gate
    `config["gate"]` and each of `config["gates"]`: `fit_held` opens them when the run reached
    the state a test waits for. A gate with a third entry holds only from that generation on:
    a rank held in its loop cannot join a formation, so a gate that a survivor may reach before
    it heals (under local SGD, a death between syncs) holds it in the healed generation instead,
    where nobody waits for it."""
    for gate_step, gate_file, *from_generation in [*config.get("gates", ()), *filter(None, [config.get("gate")])]:
        if step_index != gate_step or (from_generation and elastic.get_context().generation < from_generation[0]):
            continue
        while not os.path.exists(gate_file):
            time.sleep(0.01)


def hold_for_checkpoint(config: dict, step_index: int) -> None:
    """Hold the train loop after step `hold_for_checkpoint[0]` until the run folder
    `hold_for_checkpoint[2]` holds a complete checkpoint (`latest_complete`, the one a restart
    takes) of step `hold_for_checkpoint[1]` or later: a fault that kills every rank a few steps
    on then finds it, however slowly a loaded machine writes it in the background."""
    after, wanted, run_folder = config.get("hold_for_checkpoint", (-1, 0, ""))
    if step_index != after:
        return
    run = RunStorage(str(Path(run_folder).parent), Path(run_folder).name)
    deadline = time.monotonic() + 120
    while (latest := latest_complete(run, on_skip=lambda step, why: None)) is None or latest.step < wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"no checkpoint of step {wanted} or later was complete in {run_folder} after 120 s")
        time.sleep(0.05)


def fit_held(trainer, until, *more):
    """`trainer.fit()` with its loop held at its gate (train_loop_config["gate"]) until
    `until(events)` holds, so a test waits for a state of the run (a worker started) instead
    of racing it on a slow machine. train_loop_config["gates"] lists further gates (or, with
    no "gate", all of them), in order, and `more` the condition of each."""
    config = trainer.train_loop_config
    listed = [*([config["gate"]] if "gate" in config else []), *config.get("gates", ())]
    gates = [(gate[1], condition) for gate, condition in zip(listed, [until, *more], strict=True)]
    run = concurrent.futures.ThreadPoolExecutor(1).submit(trainer.fit)
    storage = RunStorage(trainer.run_config.storage_path, trainer.run_config.name, trainer.run_config.storage_filesystem)
    for gate_file, condition in gates:
        while not run.done() and not condition(read_events(storage)):
            time.sleep(0.05)
        open(gate_file, "w").close()
    return run.result()


def fit_started(trainer):
    """`fit_held` until the run's `max_workers` workers started."""
    return fit_held(trainer, workers_started(trainer.scaling_config.max_workers))


def workers_started(count: int):
    """An `until` for `fit_held`: `count` workers have started."""
    return lambda events: len([e for e in events if e["type"] == "worker_started"]) >= count


def check_alike_when_formed(ctx, checked: list[int]) -> None:
    """At a generation's first step, raise unless every rank holds bit-identical synced state
    (under EASGD, with the model equal to the center); `checked` collects the generations
    checked."""
    if checked and checked[-1] == ctx.generation:
        return
    state = ctx.synced_state()
    digests = [None] * ctx.world_size
    dist.all_gather_object(digests, state_digest(*state.values()))
    if len(set(digests)) != 1:
        raise AssertionError(f"ranks differ after generation {ctx.generation} formed: {digests}")
    if ctx.strategy.sync_options["kind"] == "easgd":
        params = state["model"].values()  # build_mlp's state: its parameters, in order
        if not all(torch.equal(p, c) for p, c in zip(params, state["outer_sync"]["anchor"], strict=True)):
            raise AssertionError(f"generation {ctx.generation} did not start every rank from EASGD's center")
    checked.append(ctx.generation)


def check_synced(ctx, synced_at: list[int], model_alike: bool = True) -> None:
    """Right after a local SGD sync: the outer optimizer and the last-sync parameters (EASGD's
    center) must be the same on every rank, and so must the model if `model_alike`. Records the
    step."""
    state = ctx.synced_state()
    digests = [None] * ctx.world_size
    alike = (state["model"], state["outer_sync"]) if model_alike else (state["outer_sync"],)
    dist.all_gather_object(digests, state_digest(*alike))
    if len(set(digests)) != 1:
        raise AssertionError(f"ranks differ after the sync at step {ctx.step}: {digests}")
    synced_at.append(ctx.step)


def check_collectives(collectives, rank: int) -> int:
    """Call every collective and compare its answer with the one computed from the world size;
    raises AssertionError on a wrong answer. Returns the world size."""
    world = collectives.world_size
    ranks = torch.arange(world, dtype=torch.float64)
    answers = {
        "all_reduce sum": (collectives.all_reduce(torch.tensor([rank + 1.0])), (ranks + 1).sum()),
        "all_reduce mean": (collectives.all_reduce(torch.tensor([rank + 1.0]), op="mean"), (ranks + 1).mean()),
        "all_reduce max": (collectives.all_reduce(torch.tensor([float(rank)]), op="max"), ranks.max()),
        "sample_mean": (collectives.sample_mean(torch.tensor([float(rank)], dtype=torch.float64), samples=rank + 1),
                        (ranks * (ranks + 1)).sum() / (ranks + 1).sum()),
        "all_gather": (torch.cat(collectives.all_gather(torch.tensor([float(rank)]))), ranks),
        "broadcast": (collectives.broadcast(torch.tensor([float(rank)]), src=world - 1), ranks[-1]),
        "reduce_scatter": (collectives.reduce_scatter(torch.arange(2.0 * world)),
                           world * torch.arange(2.0 * world)[2 * rank: 2 * rank + 2]),
        "all_to_all": (torch.cat(collectives.all_to_all([torch.tensor([10.0 * rank + i]) for i in range(world)])),
                       10.0 * ranks + rank),
    }
    for name, (got, expected) in answers.items():
        if not torch.allclose(got.double(), torch.as_tensor(expected, dtype=torch.float64)):
            raise AssertionError(f"{name} at world size {world} on rank {rank}: {got.tolist()}, not {expected}")
    return world


class OutsideKiller(threading.Thread):
    """Sends SIGKILL to workers of a running fit() from this process, when the run is where
    the cell says: it reads the controller's status and the run's journal. "mid-step" kills rank
    `victim` of the generation of `world_size` ranks at a random moment of a step after
    `from_step`."""

    def __init__(self, kind, storage, name, pace, seed, victim=1, world_size=3, from_step=12):
        super().__init__(daemon=True)
        self.kind, self.storage, self.name, self.pace = kind, storage, name, pace
        self.victim, self.world_size, self.from_step = victim, world_size, from_step
        self.rng = random.Random(seed)
        self.killed: list[int] = []
        self.done = threading.Event()

    def run(self):
        try:
            if self.kind == "newcomer":
                # The replacement's grow: the start may have formed without a slow worker, which a
                # grow then took in before anyone died.
                failed = self._wait_for(lambda e: e["type"] == "worker_failed")
                grow = self._wait_for(lambda e: e["type"] == "generation_formed" and e["kind"] == "grow"
                                      and e["time"] > failed["time"])
                self._kill(grow["members"][-1]["pid"])
                return
            self._wait_for_step(self.from_step if self.kind != "all" else 20)
            members = self._latest_members()
            if self.kind == "mid-step":
                time.sleep(self.rng.uniform(0, max(self.pace.compute_s, 0.01)))
                self._kill(members[self.victim]["pid"])
            elif self.kind == "ranks1-2-within-100ms":
                self._kill(members[1]["pid"])
                time.sleep(self.rng.uniform(0.0, 0.1))
                self._kill(members[2]["pid"])
            elif self.kind == "rank0":
                self._kill(members[0]["pid"])
            elif self.kind == "all":
                for member in members:
                    self._kill(member["pid"])
        finally:
            self.done.set()

    def _kill(self, pid):
        os.kill(pid, signal.SIGKILL)
        self.killed.append(pid)

    def _events(self):
        return read_events(RunStorage(self.storage, self.name))

    def _wait_for(self, match, timeout_s=120):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            found = [e for e in self._events() if match(e)]
            if found:
                return found[-1]
            time.sleep(0.01)
        raise TimeoutError(f"the run never reached the moment for {self.kind}")

    def _wait_for_step(self, step):
        controller = None
        while controller is None or ray.get(controller.status.remote())["step"] < step:
            time.sleep(0.02)
            try:
                controller = controller or ray.get_actor(f"elastic-controller-{self.name}")
            except ValueError:
                continue

    def _latest_members(self):
        self._wait_for(lambda e: e["type"] == "generation_formed" and e["world_size"] == self.world_size)
        return [e for e in self._events() if e["type"] == "generation_formed"][-1]["members"]
