"""What elastic's step machinery costs per step, in CPU microseconds, apart from the noise of a shared machine.

    .venv/bin/python -m benchmarks.step_overhead                # 3 rounds of 400 step pairs, under a minute
    .venv/bin/python -m benchmarks.step_overhead --rounds 1 --steps 100 --out /tmp/overhead.json

Run it from the repository root. `steady_step_ratio_vs_torch_with_ray` (benchmarks/bench.py)
compares wall-clock step times of ~10 ms on 2 cores that Ray's daemons and anything else
running share, so a few percent of it is the machine's mood. This measures only what elastic
adds: one process, a gloo group of world size 1, and two train loops over the benchmark's
workload (benchmarks/workload.py: the same MLP, SGD and 64 samples a step, the per-worker
share of bench.py's runs) that take turns step by step:

- plain: a `DistributedDataParallel` of the model, the step's samples indexed from the
  dataset, forward, backward, `optimizer.step()`, `zero_grad()`;
- elastic: a real `TrainContext` (no Ray; the controller's offer is made here, as in
  tests/test_generations.py) over the same group, its loop exactly bench.py's elastic loop:
  `ctx.steps`, `with step`, `step.micro_batches()`, `mb.backward`, the prepared optimizer.

Each step is timed in CPU time of the whole process (`time.process_time_ns`), to which another
process's load adds no waiting (only its share of caches and cores), from the loop's request
for the step to the step's end (elastic's part between two steps included). The order
alternates, so that neither loop always runs on caches the other warmed. A round's overhead
is the median over its step pairs of elastic's CPU time minus plain's;
`steady_step_overhead_us` is the median over rounds, with min, median and max under `spread`,
merged into benchmarks/results/bench.json (or --out) beside the ratio, with the load average
at the start and end of each round.

Not in this figure: a real worker's report thread and the controller's calls, which run on
other threads of its Ray actor. In the figure: the gradient all-reduce, which in bench.py's
runs (gloo, 2 ranks, no fault, no compression) is DDP's own in both loops, elastic installing
no comm hook there; elastic's DDP cuts it into GLOO_BUCKET_CAP_MB buckets (two here), plain
DDP into torch's 25 MB (one).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks import workload
from benchmarks.bench import command_line, merge_figures, parse_rounds
from elastic.comm.group import GenerationSpec
from elastic.config import DataConfig
from elastic.worker.context import TrainContext
from elastic.worker.mailbox import GenerationMailbox

STEPS = 400
"""Step pairs timed in each round, after the warm-up."""
SHARE = workload.GLOBAL_BATCH // workload.WORLD_SIZE  # samples per step: one rank's share in bench.py
DEFINITIONS = {
    "steady_step_overhead_us": "elastic's CPU time per steady step minus plain DDP's on the same workload "
    "(benchmarks/step_overhead.py: one process, gloo world size 1, the two loops taking turns step by step, "
    "process CPU time), in microseconds: the median over a round's step pairs; median over rounds",
}


def main(argv: list[str] | None = None) -> int:
    _, args = parse_rounds(__doc__, argv, lambda parser: parser.add_argument(
        "--steps", type=int, default=STEPS, help="step pairs timed in each round (default: %(default)s)"))
    torch.set_num_threads(1)
    started = time.time()
    rounds = _measure(args.rounds, args.steps)
    figures = {"steady_step_overhead_us": [r["overhead_us"] for r in rounds]}
    details = {"steady_step_overhead": {
        "world_size": 1, "samples_per_step": SHARE, "steps_per_round": args.steps,
        "clock": "time.process_time_ns", "rounds": rounds}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.step_overhead", argv),
                  time.time() - started)
    for i, r in enumerate(rounds):
        print(f"round {i}: elastic {r['elastic_us']:.0f} us, plain {r['plain_us']:.0f} us, "
              f"overhead {r['overhead_us']:.1f} us; load average {r['load_before']} -> {r['load_after']}")
    print(f"steady_step_overhead_us {statistics.median(figures['steady_step_overhead_us']):.1f}\nwrote {args.out}")
    return 0


def _measure(rounds: int, steps: int) -> list[dict[str, Any]]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mailbox = GenerationMailbox()
    ctx = TrainContext(DataConfig(global_batch_size=SHARE, micro_batch_size=workload.MICRO_BATCH,
                                  max_steps=workload.WARMUP_STEPS + rounds * steps + 1, seed=workload.SEED),
                       mailbox, [], lambda report: None, use_gpu=False)
    model = ctx.prepare_model(workload.make_model())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=workload.LR))
    mailbox.offer(GenerationSpec(generation=0, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                                 store_host="127.0.0.1", store_port=store.port, backend="gloo", reason="start",
                                 collective_timeout_s=60))
    dataset = workload.make_dataset()
    steps_of = iter(ctx.steps(dataset))

    def elastic_step() -> None:
        step = next(steps_of)
        with step:
            for mb in step.micro_batches():
                inputs, labels = mb.data
                mb.backward(workload.loss_fn(model(inputs), labels))
            optimizer.step()
            optimizer.zero_grad()

    elastic_step()  # forms the generation: the default group the plain loop uses too
    plain_model = DistributedDataParallel(workload.make_model())
    plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=workload.LR)
    inputs, labels = dataset.tensors
    plain_index = 0

    def plain_step() -> None:
        nonlocal plain_index
        # Rank 0's share of bench.py's global step: its samples, and the cost of finding them.
        indices = workload.rank_indices(plain_index, workload.WORLD_SIZE, 0)
        plain_index += 1
        loss = workload.loss_fn(plain_model(inputs[indices]), labels[indices])
        loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()

    for _ in range(workload.WARMUP_STEPS - 1):
        plain_step()
        elastic_step()
    results = []
    for _ in range(rounds):
        load_before = os.getloadavg()
        plain_ns, elastic_ns = [], []
        for i in range(steps):
            for run, times in ((plain_step, plain_ns), (elastic_step, elastic_ns))[:: 1 if i % 2 else -1]:
                began = time.process_time_ns()
                run()
                times.append(time.process_time_ns() - began)
        load_after = os.getloadavg()
        results.append({
            "overhead_us": statistics.median(e - p for e, p in zip(elastic_ns, plain_ns)) / 1e3,
            "elastic_us": statistics.median(elastic_ns) / 1e3,
            "plain_us": statistics.median(plain_ns) / 1e3,
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in load_after],
        })
    ctx.close()
    return results


if __name__ == "__main__":
    sys.exit(main())
