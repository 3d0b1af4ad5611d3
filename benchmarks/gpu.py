"""The GPU figures, in one prepared script for a machine with CUDA (run from the repository root):

    .venv/bin/python -m benchmarks.gpu                      # writes benchmarks/results/gpu.json
    .venv/bin/python -m benchmarks.gpu --out /tmp/gpu.json --rounds 2
    .venv/bin/python -m benchmarks.gpu --cpu --out /tmp/gpu_cpu.json   # the script's logic on CPUs

Without CUDA, and without `--cpu`, it says so and exits with code 2. The report is written after
each part, so a run cut short keeps what it measured; a part that fails is named under `failed`
and the next one runs (the exit code is then 1); within a part, so is a world size or a contender
that fails, and processes that hang are killed at a deadline. It measures, each as min, median
and max:

- NCCL generations, the way a worker joins and leaves them (`elastic.comm.group`): one process per
  rank (world sizes 1, 2 and 4; ranks beyond the GPUs share them, each a host of its own to NCCL
  as a worker holding a share of a GPU is) forms generation 0 (timed from the store barrier's
  end: `init_process_group` and the first all-reduce, which is when NCCL builds its communicator),
  then heals as a worker does (`GenerationGroup.abort`, then `leave_group`) and forms the next
  one, GENERATIONS times. `critical_path_s` is what the heal's path spends on the abort (the
  abort and the leave, on the train thread), `nccl_abort_on_critical_path_s` at the report's top
  level; `abort_s` is the abort itself, on the retirement thread (`elastic.comm.retirement`);
  `reform_s` is each later formation, made while the one before is still being aborted;
- the demo's LM (`elastic.demo.model.TinyLM` with the demo's ModelConfig, AdamW, a batch of
  LM_BATCH windows of the demo's length) on one GPU: steps per second in fp32 and under bf16
  autocast;
- the checkpoint stall from GPU memory: `elastic.checkpoint.checkpoint.take_snapshot` of a model and its
  AdamW state of about SNAPSHOT_PARAMS parameters (~SNAPSHOT_PARAMS * 12 bytes) into the reused,
  pinned buffers of a `HostBuffers` pool (as a worker takes it), against a plain `.cpu()` copy of
  every tensor of the same state and against the floor, a non-blocking copy of every tensor into
  pinned buffers kept across rounds;
- the steady step of a plain torch loop, plain DDP and elastic side by side, at the demo LM's size
  and a larger one (`benchmarks.gpu_step`): `step_ratio_vs_plain_torch`, `step_ratio_vs_plain_ddp`
  (world size 1), `step_ratio_vs_plain_ddp_2_ranks` (two ranks sharing the GPU) and
  `checkpointed_step_ratio` (a checkpoint every 50 steps against none), each per size;
- healing through Ray with ranks sharing the GPU (`benchmarks.gpu_heal`): `nccl_shared_gpu` (the
  recovery at 2 and 4 ranks, the grow pause) and `restart_after_every_worker_s`.

`--cpu` runs the generations (gloo groups on NCCL's path), the step contenders and the heals on
CPUs over gloo (smaller models, longer runs): it checks the script's logic on a machine without a
GPU, and its figures say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks import gpu_heal, gpu_step
from benchmarks.gpu_step import attempt, run_processes, spread
from benchmarks.bench import _provenance, command_line

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results", "gpu.json")
NEEDS_GPU_EXIT = 2
GENERATIONS = 5
LM_BATCH = 32  # the demo's global batch
LM_WARMUP_STEPS, LM_STEPS = 20, 200
SNAPSHOT_PARAMS = 200_000_000  # fp32 weights and two AdamW moments: ~2.4 GB on the GPU
SNAPSHOT_ROUNDS = 5
# The step figures at the report's top level, as issue 40 names them (benchmarks/results/gpu.json).
STEP_KEYS = ("step_ratio_vs_plain_torch", "step_ratio_vs_plain_ddp", "step_ratio_vs_plain_ddp_2_ranks",
             "checkpointed_step_ratio")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"where to write the JSON (default: {DEFAULT_OUT}; "
                        "with --cpu, nowhere)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the step contenders (default: %(default)s)")
    parser.add_argument("--heal-rounds", type=int, default=1,
                        help="rounds of the heals through Ray (benchmarks.gpu_heal; default: %(default)s)")
    parser.add_argument("--cpu", action="store_true",
                        help="the generations, the step contenders and the heals on CPUs: a check of the script")
    args = parser.parse_args(argv)
    started = time.time()
    out = args.out if args.cpu else args.out or DEFAULT_OUT
    if args.cpu:
        report: dict[str, Any] = {}
        parts = _cpu_parts(args)
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU, and this machine has none (torch.cuda.is_available() is False). "
              "Run it on a GPU machine; the CPU figures come from benchmarks.bench and benchmarks.scale.",
              file=sys.stderr)
        return NEEDS_GPU_EXIT
    else:
        report = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
        parts = _gpu_parts(args)
    _start_ray(args.cpu)
    # Each part's figures are written as they come, and a part that fails is recorded and the next one
    # runs: on a lent GPU's short budget, one broken part must not cost the others.
    failed: dict[str, str] = {}
    for name, part in parts:
        report.update(attempt(name, part, failed) or {})
        if failed:
            report["failed"] = failed
        report.update(_provenance(command_line("benchmarks.gpu", argv), time.time() - started))
        _save(report, out)
    print(json.dumps(report, indent=2))
    if out is not None:
        print(f"\nwrote {out}")
    return 1 if "failed" in report else 0


def _start_ray(cpu: bool) -> None:
    """One local Ray for every part, with the machine's GPUs, no dashboard and no worker logs in the output."""
    import ray

    ray.init(address="local", num_cpus=4 if cpu else os.cpu_count(), num_gpus=0 if cpu else torch.cuda.device_count(),
             include_dashboard=False, log_to_driver=False)


def _generations(cpu: bool) -> dict[str, Any]:
    """`nccl_generations` at 1, 2 and 4 ranks, each on its own: a size that fails is recorded, the next one runs."""
    figures: dict[str, Any] = {}
    for size in (1, 2, 4):
        failed: dict[str, str] = {}  # a size that fails reads {"failed": its error}
        figures[str(size)] = attempt("failed", lambda: nccl_generations(size, cpu=cpu), failed) or failed
    return {"nccl_generations": figures, "nccl_abort_on_critical_path_s": figures["2"].get("critical_path_s")}


def _gpu_parts(args: argparse.Namespace) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    def step() -> dict[str, Any]:
        figures = gpu_step.step_ratios(rounds=args.rounds)
        return {**{key: figures.pop(key) for key in STEP_KEYS}, "step": figures}

    # The issues' figures first (38: the abort and the heals; 40: the stall and the step), the LM's
    # own speed last: a run cut short by a lent GPU's budget keeps the ones that decide most.
    return [("nccl_generations", lambda: _generations(cpu=False)),
            ("heal", lambda: gpu_heal.heal_figures(rounds=args.heal_rounds)),
            ("checkpoint_stall", lambda: {"checkpoint_stall": checkpoint_stall()}),
            ("step", step),
            ("lm_steps_per_s", lambda: {"lm_steps_per_s": {p: lm_steps_per_s(p) for p in ("fp32", "bf16")}})]


def _cpu_parts(args: argparse.Namespace) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    return [("nccl_generations", lambda: _generations(cpu=True)),
            ("step", lambda: {"step": gpu_step.step_ratios(cpu=True, rounds=args.rounds)}),
            ("heal", lambda: gpu_heal.heal_figures(cpu=True, rounds=args.heal_rounds))]


def _save(report: dict[str, Any], out: str | None) -> None:
    if out is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


# --- NCCL generations ---------------------------------------------------------------------------
def nccl_generations(world_size: int, cpu: bool = False) -> dict[str, Any]:
    """Form, abort and re-form NCCL generations in the same processes, one per rank. `cpu`: gloo groups
    stand in for NCCL's on the same path (`--cpu`: a check of the script, its figures none of NCCL's)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    results = mp.get_context("spawn").Manager().dict()  # not forked from a process that initialized CUDA
    run_processes(_generations_member, (world_size, store.port, cpu, results), world_size)
    ranks = [results[r] for r in range(world_size)]
    # A generation is formed when its slowest member is: the most over ranks, per generation.
    slowest = {key: [max(r[key][g] for r in ranks) for g in range(len(ranks[0][key]))]
               for key in ("form_s", "abort_s", "critical_path_s")}
    return {"first_form_s": slowest["form_s"][0], "reform_s": spread(slowest["form_s"][1:]),
            "abort_s": spread(slowest["abort_s"]), "critical_path_s": spread(slowest["critical_path_s"]),
            "generations": GENERATIONS}


def _generations_member(rank: int, world_size: int, port: int, cpu: bool, results: Any) -> None:
    from elastic.comm.binding import separate_ranks_sharing_a_gpu
    from elastic.comm.generation import GenerationGroup
    from elastic.comm.group import GenerationSpec, GradientAllReduce, StoreClient, form_group, leave_group, rendezvous
    from elastic.comm.links import GroupLinks
    from elastic.comm.retirement import retirement

    device = torch.device("cpu") if cpu else torch.device("cuda", rank % torch.cuda.device_count())
    if not cpu:
        torch.cuda.set_device(device)
        if world_size > torch.cuda.device_count():  # as a worker holding a share of a GPU does
            separate_ranks_sharing_a_gpu(rank, torch.cuda.device_count() / world_size)
    store = StoreClient().get("127.0.0.1", port)
    times: dict[str, list[float]] = {"form_s": [], "critical_path_s": []}
    for generation in range(GENERATIONS):
        spec = GenerationSpec(generation=generation, rank=rank, world_size=world_size, local_rank=rank,
                              local_world_size=world_size, node_rank=0, store_host="127.0.0.1", store_port=port,
                              backend="gloo" if cpu else "nccl", reason="benchmark", collective_timeout_s=60.0)
        if not rendezvous(spec, store):
            raise RuntimeError(f"generation {generation} was aborted; nothing here aborts it")
        began = time.perf_counter()  # after the barrier: not the wait for slower ranks to start
        form_group(spec, store)  # while the generation before is still being aborted
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)  # NCCL builds the communicator on the first collective
        if not cpu:
            torch.cuda.synchronize()
        times["form_s"].append(time.perf_counter() - began)
        # A heal as a worker makes it: the control thread aborts the stale generation, the train thread leaves it.
        stale = GenerationGroup(generation, "nccl", dist.group.WORLD, GroupLinks(frozenset()),
                                GradientAllReduce(generation, abortable=False))
        healing = time.perf_counter()
        stale.abort("benchmarks.gpu: a heal")
        leave_group("nccl")
        times["critical_path_s"].append(time.perf_counter() - healing)
    if not retirement.wait_idle(60):
        raise TimeoutError("the retirement thread's NCCL aborts did not end within 60 s")
    # Two batches per generation: the control thread's abort, and the leave's of a communicator already aborted,
    # which returns at once; the control thread's may run before an earlier leave's. Each generation's abort is
    # one of the GENERATIONS longest.
    times["abort_s"] = sorted(retirement.seconds)[-GENERATIONS:]
    results[rank] = times


def lm_steps_per_s(precision: str) -> dict[str, Any]:
    """Training steps per second of the demo's LM on one GPU, in fp32 or under bf16 autocast."""
    from elastic.demo.corpus import VOCAB_SIZE
    from elastic.demo.model import ModelConfig, TinyLM

    config = ModelConfig()
    model = TinyLM(config, seed=0).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, VOCAB_SIZE, (LM_BATCH, config.seq_len + 1), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        with autocast:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(LM_WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(LM_STEPS):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    params = sum(p.numel() for p in model.parameters())
    return {"steps_per_s": LM_STEPS / elapsed, "step_s": elapsed / LM_STEPS, "steps": LM_STEPS,
            "batch": LM_BATCH, "seq_len": config.seq_len, "parameters": params}


# --- checkpoint stall from GPU memory -----------------------------------------------------------------
def checkpoint_stall() -> dict[str, Any]:
    """`take_snapshot` of a GPU-resident model and AdamW state against a plain `.cpu()` copy."""
    from elastic.checkpoint.checkpoint import take_snapshot
    from elastic.checkpoint.host_buffers import HostBuffers
    from elastic.comm.state_sync import state_of

    width = 4096
    layers = max(1, SNAPSHOT_PARAMS // (width * width))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers))).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, width, device="cuda")).sum().backward()
    optimizer.step()  # creates both moments: the state a checkpoint holds
    states = {"model": state_of(model), "optimizer": state_of(optimizer)}
    tensors = [t for t in _tensors(states)]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    progress = {"step": 1, "cursor": {"epoch": 0, "consumed": 0, "seed": 0}}

    pool = HostBuffers()  # as a worker's Snapshots keeps it: pinned, reused once a snapshot is written

    def snapshot() -> None:
        take_snapshot(states, progress, pool=pool).release()

    def plain_copy() -> None:
        [t.cpu() for t in tensors]

    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def pinned_copy() -> None:  # the floor: a non-blocking copy of every tensor into pinned buffers kept
        for target, tensor in zip(pinned, tensors):
            target.copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()

    snapshot()  # the pool's first buffers are allocated (and pinned) once per run, not per checkpoint
    stall, copy, floor = [], [], []
    for _ in range(SNAPSHOT_ROUNDS):  # alternate, so drift in the machine hits all alike
        stall.append(_synchronized(snapshot))
        copy.append(_synchronized(plain_copy))
        floor.append(_synchronized(pinned_copy))
    return {"bytes": state_bytes, "stall_s": spread(stall), "plain_cpu_copy_s": spread(copy),
            "pinned_copy_s": spread(floor),
            "stall_ratio_vs_plain_copy": statistics.median(stall) / statistics.median(copy),
            "stall_ratio_vs_pinned_copy": statistics.median(stall) / statistics.median(floor),
            "rounds": SNAPSHOT_ROUNDS}


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _synchronized(function: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - began


if __name__ == "__main__":
    sys.exit(main())
