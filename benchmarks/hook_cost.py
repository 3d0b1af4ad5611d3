"""What a Python comm hook costs DDP's step at 2 ranks, against DDP's own C++ all-reduce, side by side.

    .venv/bin/python -m benchmarks.hook_cost                    # 3 rounds of 300 step triples, about a minute
    .venv/bin/python -m benchmarks.hook_cost --rounds 1 --out /tmp/hook.json

Run it from the repository root. Two gloo processes (no Ray), one torch thread each, train the
benchmark's workload (benchmarks/workload.py: the MLP, SGD, a 64-sample share a rank) as three
DDP instances of the same model on the same group, in elastic's buckets (GLOO_BUCKET_CAP_MB),
taking turns step by step so that the machine's mood falls on all three alike:

- plain: DDP's own all-reduce, no hook;
- hook: the hook every gloo generation installs (`elastic.worker.membership._allreduce_hook`'s
  path with no technique: the faults' check, then `flat_all_reduce`);
- abortable: the same all-reduce through an abortable `GradientAllReduce`, as generations of 4
  ranks or more installed before every abort severed the generation's connections.

Each step is timed in wall time on rank 0 from the forward to the end of `optimizer.step()`. A
round's ratio is the median hooked step over the median plain step;
`hook_cost_ratio_2_ranks` (the hook every generation now installs) and
`abortable_hook_cost_ratio_2_ranks` are the medians over rounds, with min, median and max under
`spread`, merged into benchmarks/results/bench.json (or --out).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from benchmarks import workload
from benchmarks.bench import command_line, merge_figures, parse_rounds, print_medians
from elastic.comm.group import GradientAllReduce, flat_all_reduce
from elastic.worker.data_parallel import GLOO_BUCKET_CAP_MB

STEPS = 300
SHARE = workload.GLOBAL_BATCH // workload.WORLD_SIZE
KINDS = ("plain", "hook", "abortable")


def _plain_hook(state, bucket):
    """The hook of a gloo generation with no technique and no fault: a flat all-reduce of the bucket."""
    return flat_all_reduce(bucket.buffer())


def _abortable_hook(gradients, bucket):
    return gradients.all_reduce(bucket.buffer())


def _member(rank: int, port: int, steps: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=workload.WORLD_SIZE)
    dataset = workload.make_dataset()
    models = {}
    for kind in KINDS:
        ddp = DistributedDataParallel(workload.make_model(), bucket_cap_mb=GLOO_BUCKET_CAP_MB)
        if kind == "hook":
            ddp.register_comm_hook(None, _plain_hook)
        elif kind == "abortable":
            ddp.register_comm_hook(GradientAllReduce(0, abortable=True), _abortable_hook)
        models[kind] = (ddp, torch.optim.SGD(ddp.parameters(), lr=workload.LR))
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for step in range(workload.WARMUP_STEPS + steps):
        start = step * workload.GLOBAL_BATCH + rank * SHARE
        indices = torch.arange(start, start + SHARE) % workload.NUM_SAMPLES
        inputs, labels = dataset.tensors[0][indices], dataset.tensors[1][indices]
        order = KINDS if step % 2 == 0 else KINDS[::-1]
        for kind in order:
            ddp, optimizer = models[kind]
            began = time.perf_counter()
            workload.loss_fn(ddp(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= workload.WARMUP_STEPS:
                times[kind].append(time.perf_counter() - began)
    if rank == 0:
        results["times"] = {kind: statistics.median(values) for kind, values in times.items()}
    dist.destroy_process_group()


def one_round(steps: int) -> dict[str, float]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = mp.Manager().dict()
    mp.start_processes(_member, args=(store.port, steps, results), nprocs=workload.WORLD_SIZE, start_method="spawn")
    return dict(results["times"])


def main(argv: list[str] | None = None) -> int:
    _, args = parse_rounds(__doc__, argv, lambda p: p.add_argument("--steps", type=int, default=STEPS))
    started = time.time()
    figures: dict[str, list[float | None]] = {"hook_cost_ratio_2_ranks": [], "abortable_hook_cost_ratio_2_ranks": []}
    for index in range(args.rounds):
        load = os.getloadavg()[0]
        times = one_round(args.steps)
        figures["hook_cost_ratio_2_ranks"].append(times["hook"] / times["plain"])
        figures["abortable_hook_cost_ratio_2_ranks"].append(times["abortable"] / times["plain"])
        print(f"round {index + 1}/{args.rounds}: plain {times['plain'] * 1e3:.2f} ms, hook {times['hook'] * 1e3:.2f} ms, "
              f"abortable {times['abortable'] * 1e3:.2f} ms, load {load:.1f}", flush=True)
    merge_figures(args.out, figures, {}, {
        "hook_cost_ratio_2_ranks": "DDP's step with the comm hook every gloo generation installs over DDP's own "
                                   "all-reduce, 2 gloo ranks, the benchmark's MLP, wall time, the three kinds taking "
                                   "turns step by step (benchmarks/hook_cost.py)",
        "abortable_hook_cost_ratio_2_ranks": "the same with the all-reduce through an abortable GradientAllReduce "
                                             "(what generations of 4 ranks or more installed before)",
    }, command_line("benchmarks.hook_cost", argv), time.time() - started)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
