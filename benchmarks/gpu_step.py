"""The steady step on one GPU: a plain torch loop, plain DDP and elastic, side by side (issue 40).

Every contender trains the same LM step: the demo's `TinyLM` with AdamW on random token windows,
batches from a `DataLoader` over pinned memory moved with `non_blocking=True` (elastic's loader
pins on CUDA itself), the loss read nowhere. Two sizes: SMALL, the demo's LM with a batch of 32
(about 6 ms a step on an H200), and LARGE, d=512, 6 layers, 8 heads, a batch of 64 (about 27 ms).
Each run times STEPS steps after WARMUP with the device synchronized at both ends. The
contenders, in an order rotated each round so that drift hits every position alike; a contender
that fails is recorded under `failed` and its ratios left out, and the others still run:

- `plain_torch`: one process, no DDP;
- `plain_ddp_1`, `plain_ddp_2`: DistributedDataParallel in processes of torch.multiprocessing at
  world size 1 and at 2 ranks sharing the GPU (each rank a host of its own to NCCL, as elastic's
  workers sharing a GPU are: `elastic.comm.binding.separate_ranks_sharing_a_gpu`);
- `elastic_1`, `elastic_2`: `ElasticTrainer` through Ray at the same world sizes, the global batch
  the same, each rank's share in one micro-batch;
- `elastic_1_checkpointed`: `elastic_1` with a checkpoint every CHECKPOINT_EVERY steps.

Ray runs throughout, so every contender shares its daemons. With `cpu=True` the same logic runs on
CPUs over gloo with a smaller model (`benchmarks.gpu --cpu`), which checks the script where there
is no GPU; its figures say nothing of a GPU.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WARMUP, STEPS = 20, 200
CHECKPOINT_EVERY = 50
PROCESSES_DEADLINE_S = 180.0  # a run of plain DDP's processes, or of the NCCL generations
CONTENDERS = ("plain_torch", "plain_ddp_1", "elastic_1", "plain_ddp_2", "elastic_2", "elastic_1_checkpointed")


@dataclass(frozen=True)
class Size:
    d_model: int
    n_layers: int
    n_heads: int
    batch: int
    seq_len: int = 128


SIZES = {"small": Size(128, 2, 4, 32), "large": Size(512, 6, 8, 64)}
CPU_SIZES = {"small": Size(32, 1, 2, 8, seq_len=16), "large": Size(64, 2, 4, 16, seq_len=32)}
CPU_WARMUP, CPU_STEPS = 3, 12


@dataclass(frozen=True)
class Setting:
    """One contender's run: the model size, where it runs, and how long."""

    size: Size
    cpu: bool
    warmup: int
    steps: int

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.cpu else torch.device("cuda", 0)


def step_ratios(cpu: bool = False, rounds: int = 3) -> dict[str, Any]:
    """Every contender's step time at both sizes, `rounds` times, and elastic's ratios to the plain loops."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the loop and its Setting, to the workers
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4 if cpu else os.cpu_count(), num_gpus=0 if cpu else 1,
                 include_dashboard=False, log_to_driver=False)
    sizes = CPU_SIZES if cpu else SIZES
    warmup, steps = (CPU_WARMUP, CPU_STEPS) if cpu else (WARMUP, STEPS)
    times: dict[str, dict[str, list[float | None]]] = {name: {c: [] for c in CONTENDERS} for name in sizes}
    failed: dict[str, str] = {}
    for round_index in range(rounds):
        for name, size in sizes.items():
            setting = Setting(size, cpu, warmup, steps)
            shift = round_index % len(CONTENDERS)
            for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
                step_s = attempt(f"{name}.{contender}.round_{round_index}", lambda: RUNS[contender](setting), failed)
                times[name][contender].append(step_s)
                print(f"[gpu_step] round {round_index} {name} {contender}: "
                      f"{'failed' if step_s is None else f'{step_s * 1e3:.2f} ms'}", file=sys.stderr, flush=True)
    report: dict[str, Any] = {"device": "cpu" if cpu else torch.cuda.get_device_name(0), "rounds": rounds,
                              "warmup": warmup, "steps": steps, "sizes": {n: asdict(s) for n, s in sizes.items()},
                              "step_s": {n: {c: spread(t) for c, t in by.items()} for n, by in times.items()}}
    for key, over, under in (("step_ratio_vs_plain_torch", "elastic_1", "plain_torch"),
                             ("step_ratio_vs_plain_ddp", "elastic_1", "plain_ddp_1"),
                             ("step_ratio_vs_plain_ddp_2_ranks", "elastic_2", "plain_ddp_2"),
                             ("checkpointed_step_ratio", "elastic_1_checkpointed", "elastic_1")):
        # Per round: each ratio compares runs made minutes apart at most.
        report[key] = {name: spread([a / b if a is not None and b is not None else None
                                     for a, b in zip(times[name][over], times[name][under])])
                       for name in sizes}
    if failed:
        report["failed"] = failed
    return report


# --- the step every contender trains ---------------------------------------------------------------
def _model(setting: Setting) -> torch.nn.Module:
    from elastic.demo.model import ModelConfig, TinyLM

    size = setting.size
    config = ModelConfig(seq_len=size.seq_len, d_model=size.d_model, n_layers=size.n_layers, n_heads=size.n_heads)
    return TinyLM(config, seed=0).to(setting.device)


def _dataset(setting: Setting) -> torch.utils.data.TensorDataset:
    from elastic.demo.corpus import VOCAB_SIZE

    windows = setting.size.batch * (setting.warmup + setting.steps + 1)
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB_SIZE, (windows, setting.size.seq_len + 1), generator=generator))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _synchronize(setting: Setting) -> None:
    if not setting.cpu:
        torch.cuda.synchronize()


def _timed_loop(setting: Setting, model: torch.nn.Module, loader: Any) -> float:
    """A plain loop over `loader`: the mean step time past the warm-up."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    began = 0.0
    for index, (tokens,) in enumerate(loader):
        if index == setting.warmup:
            _synchronize(setting)
            began = time.perf_counter()
        if index == setting.warmup + setting.steps:
            break
        _loss(model, tokens.to(setting.device, non_blocking=True)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _synchronize(setting)
    return (time.perf_counter() - began) / setting.steps


def _loader(setting: Setting, batch: int, sampler: Any = None) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_dataset(setting), batch_size=batch, sampler=sampler, drop_last=True,
                                       pin_memory=not setting.cpu)


# --- plain torch and plain DDP -----------------------------------------------------------------------
def plain_torch(setting: Setting) -> float:
    if setting.cpu:
        torch.set_num_threads(1)
    return _timed_loop(setting, _model(setting), _loader(setting, setting.size.batch))


def plain_ddp(setting: Setting, world_size: int) -> float:
    """DDP at `world_size` ranks on the one device; rank 0's mean step time."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    with tempfile.TemporaryDirectory(prefix="bench-gpu-ddp-") as out_dir:
        run_processes(_ddp_rank, (world_size, store.port, setting, out_dir), world_size)
        with open(os.path.join(out_dir, "rank0")) as f:
            return float(f.read())


def run_processes(function: Any, args: tuple, nprocs: int, deadline_s: float = PROCESSES_DEADLINE_S) -> None:
    """`function(rank, *args)` in `nprocs` spawned processes, joined within `deadline_s`: a hung rank is
    killed with the others (none may keep holding the GPU for the next run) and raises TimeoutError."""
    context = mp.start_processes(function, args=args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{nprocs} processes of {function.__name__} did not end within {deadline_s:g} s")


def _ddp_rank(rank: int, world_size: int, port: int, setting: Setting, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    from elastic.comm.binding import separate_ranks_sharing_a_gpu

    if setting.cpu:
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(0)
        separate_ranks_sharing_a_gpu(rank, 1 / world_size)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo" if setting.cpu else "nccl", store=store, rank=rank, world_size=world_size)
    model = DistributedDataParallel(_model(setting), device_ids=None if setting.cpu else [0])
    sampler = DistributedSampler(_dataset(setting), num_replicas=world_size, rank=rank, shuffle=False)
    step_s = _timed_loop(setting, model, _loader(setting, setting.size.batch // world_size, sampler))
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out_dir, "rank0"), "w") as f:
            f.write(repr(step_s))


# --- elastic -------------------------------------------------------------------------------------------
def elastic_run(setting: Setting, world_size: int, checkpoint_every: int | None = None) -> float:
    """`ElasticTrainer` at `world_size` workers on the one device; rank 0's mean step time."""
    from elastic import CheckpointConfig, DataConfig, ElasticTrainer, RunConfig, ScalingConfig

    share = {"CPU": 1} if setting.cpu else {"CPU": 1, "GPU": 1 / world_size}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-elastic-") as storage:
        result = ElasticTrainer(
            _elastic_loop, train_loop_config={"setting": setting},
            scaling_config=ScalingConfig(num_workers=world_size, use_gpu=not setting.cpu, resources_per_worker=share),
            data_config=DataConfig(global_batch_size=setting.size.batch,
                                   micro_batch_size=setting.size.batch // world_size,
                                   max_steps=setting.warmup + setting.steps, shuffle=False),
            run_config=RunConfig(name="gpu-step", storage_path=storage,
                                 checkpoint_config=CheckpointConfig(every_steps=checkpoint_every)),
            show_progress=False,
        ).fit()
    return result.value["step_s"]


def _elastic_loop(config: dict[str, Any]) -> dict[str, float]:
    import elastic

    setting: Setting = config["setting"]
    ctx = elastic.get_context()
    model = ctx.prepare_model(_model(setting))
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    began = ended = 0.0
    for step in ctx.steps(_dataset(setting)):
        if step.index == setting.warmup:
            _synchronize(setting)
            began = time.perf_counter()
        with step:
            for mb in step.micro_batches():
                (tokens,) = mb.data
                mb.backward(_loss(model, tokens))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step.index == setting.warmup + setting.steps - 1:
            # The clock stops at the last timed step, before the run's end (its final checkpoint
            # and whole model), which the generator does before the loop ends.
            _synchronize(setting)
            ended = time.perf_counter()
    return {"step_s": (ended - began) / setting.steps}


RUNS = {
    "plain_torch": plain_torch,
    "plain_ddp_1": lambda s: plain_ddp(s, 1),
    "plain_ddp_2": lambda s: plain_ddp(s, 2),
    "elastic_1": lambda s: elastic_run(s, 1),
    "elastic_2": lambda s: elastic_run(s, 2),
    "elastic_1_checkpointed": lambda s: elastic_run(s, 1, CHECKPOINT_EVERY),
}


def attempt(key: str, call: Callable[[], Any], failed: dict[str, str]) -> Any:
    """`call()`, or None if it raised: the error goes into `failed` under `key` and its traceback to
    stderr. On a lent GPU's short budget one broken run must not cost the others' figures."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 (recorded: the other runs still run)
        traceback.print_exc()
        failed[key] = f"{type(exc).__name__}: {exc}"
        return None


def spread(values: list[float | None]) -> dict[str, Any] | None:
    """min, median, max and the values: how every figure of benchmarks/gpu.py is written. A value of
    None (a run that failed, a figure a run could not give) is left out of the three; None if all are."""
    measured = [value for value in values if value is not None]
    if not measured:
        return None
    return {"min": min(measured), "median": statistics.median(measured), "max": max(measured), "values": values}
