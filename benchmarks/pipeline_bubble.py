"""The pipeline bubble of GPipe and 1F1B, measured, against its theory (p-1)/(m+p-1).

    .venv/bin/python -m benchmarks.pipeline_bubble            # 3 rounds, about 40 s
    .venv/bin/python -m benchmarks.pipeline_bubble --rounds 1 --out /tmp/pipeline.json

Run it from the repository root. Two processes on this machine form a gloo group and train a
`PipelinedModel` (elastic/parallel/pipeline.py) of p = 2 stages, each stage a Linear layer of WIDTH and a
`_Busy` layer, with m = 4 and m = 8 micro-batches of MICROBATCH_ROWS rows, under GPipe and 1F1B
in turn. Per step and per stage:

- busy: the time the stage spends in torch's per-micro-batch compute, `forward_one_chunk` and
  `backward_one_chunk`, which exclude waiting for a neighbour's message;
- wall: from the step's start on both stages (after a barrier) to its end on the later one, on
  CLOCK_MONOTONIC, which both processes share;
- bubble: 1 - busy / wall, the share of the step the stage was idle; the figure is the mean of
  the two stages.

Each round is a fresh pair of processes; every configuration runs WARMUP_STEPS steps first (the
first step after a bind also infers shapes) and then STEPS steps, whose median is the round's.

The compute is mostly artificial: `_Busy` sleeps FORWARD_S in its forward and 2 x FORWARD_S in
its backward (the usual backward-to-forward ratio; the theory holds for any ratio as long as the
stages are balanced). The theory assumes every stage takes the same time per micro-batch and
that a stage idles only while it waits for the pipeline to fill and drain. On a machine of two
cores, real compute of the two stages, their gloo threads and whatever else runs share the
cores, so a matmul's length would depend on what the other stage does at that moment (the very
overlap the pipeline is about) and the figure would measure contention more than the schedule.
A sleep is compute of a fixed length that takes no core. What remains real, and is counted in
the bubble, is the rest: the Linear layers' forward and backward, autograd, the schedule's
bookkeeping and the point-to-point transfers of activations and gradients between the stages.
Keys, each a median over the rounds with min, median and max under `spread.<key>`:

- pipeline_bubble_measured.<schedule>.m<m>: the measured bubble;
- pipeline_bubble_theory.m<m>: (p-1)/(m+p-1);
- pipeline_bubble_ratio_vs_theory.<schedule>.m<m>: their ratio (1 is the theory).

The keys are merged into benchmarks/results/bench.json (or --out), keeping the others.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.bench import DEFAULT_OUT, command_line, merge_figures, print_medians
from elastic.parallel.pipeline import PipelinedModel

STAGES = 2
MICROBATCHES = (4, 8)
SCHEDULES = ("gpipe", "1f1b")
FORWARD_S = 0.02  # a stage's forward of one micro-batch; its backward sleeps twice as long
WIDTH = 256
MICROBATCH_ROWS = 32
WARMUP_STEPS = 1
STEPS = 5
DEFINITIONS = {
    "pipeline_bubble_measured": "per schedule and micro-batch count m, p=2 stages on gloo: 1 - (a stage's time in "
                                "forward_one_chunk and backward_one_chunk) / (the step's wall time, start on both "
                                "stages to end on the later), the mean of the two stages; each stage sleeps "
                                f"{FORWARD_S * 1e3:g} ms per micro-batch forward and twice that backward beside a "
                                f"real {WIDTH}x{WIDTH} Linear",
    "pipeline_bubble_theory": "(p-1)/(m+p-1) with p=2 stages, per micro-batch count m",
    "pipeline_bubble_ratio_vs_theory": "pipeline_bubble_measured over pipeline_bubble_theory, per schedule and m",
}


class _Sleep(torch.autograd.Function):
    """The identity, sleeping FORWARD_S in the forward and twice that in the backward: compute of a known length."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(2 * FORWARD_S)
        return grad


class _Busy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x)


def theory(microbatches: int, stages: int = STAGES) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(STAGES):
        layers += [nn.Linear(WIDTH, WIDTH), _Busy()]
    return nn.Sequential(*layers)


def _time_compute(pipe: PipelinedModel, busy: list[float]) -> None:
    """Add to busy[0] the time each of this stage's forward_one_chunk and backward_one_chunk calls takes."""
    for stage in pipe.pipeline_stages:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            def timed(*args, _call=getattr(stage, name), **kwargs):
                started = time.perf_counter()
                try:
                    return _call(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - started
            setattr(stage, name, timed)


def _bubbles(schedule: str, microbatches: int) -> list[float]:
    """This stage's bubble in each measured step."""
    pipe = PipelinedModel(_model(), STAGES, nn.functional.mse_loss, microbatches=microbatches, schedule=schedule)
    pipe.bind()
    busy = [0.0]
    _time_compute(pipe, busy)
    generator = torch.Generator().manual_seed(microbatches)
    x = torch.randn(microbatches * MICROBATCH_ROWS, WIDTH, generator=generator)
    y = torch.randn(microbatches * MICROBATCH_ROWS, WIDTH, generator=generator)
    bubbles = []
    for step in range(WARMUP_STEPS + STEPS):
        dist.barrier()
        busy[0] = 0.0
        started = time.perf_counter()
        pipe.step(x, y)
        ended = time.perf_counter()
        # perf_counter is CLOCK_MONOTONIC on Linux: one clock for both processes.
        times = [None] * STAGES
        dist.all_gather_object(times, (started, ended))
        wall = max(end for _, end in times) - min(start for start, _ in times)
        if step >= WARMUP_STEPS:
            bubbles.append(1 - busy[0] / wall)
    return bubbles


def _member(process: int, port: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=process, world_size=STAGES, timeout=timedelta(seconds=120))
    for schedule in SCHEDULES:
        for microbatches in MICROBATCHES:
            results[(schedule, microbatches, process)] = statistics.median(_bubbles(schedule, microbatches))
    dist.destroy_process_group()


def measure_round() -> dict[tuple[str, int, int], float]:
    """Each (schedule, m, stage)'s median bubble over its steps, in a fresh pair of processes."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = mp.Manager().dict()
    mp.start_processes(_member, args=(store.port, results), nprocs=STAGES, start_method="spawn")
    return dict(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.time()
    figures: dict[str, list[float | None]] = {}
    per_stage: dict[str, list[list[float]]] = {}
    for round_index in range(args.rounds):
        outcome = measure_round()
        for microbatches in MICROBATCHES:
            figures.setdefault(f"pipeline_bubble_theory.m{microbatches}", []).append(theory(microbatches))
            for schedule in SCHEDULES:
                stages = [outcome[(schedule, microbatches, stage)] for stage in range(STAGES)]
                measured = statistics.mean(stages)
                figures.setdefault(f"pipeline_bubble_measured.{schedule}.m{microbatches}", []).append(measured)
                figures.setdefault(f"pipeline_bubble_ratio_vs_theory.{schedule}.m{microbatches}", []).append(
                    measured / theory(microbatches))
                per_stage.setdefault(f"{schedule}.m{microbatches}", []).append(stages)
                print(f"round {round_index + 1}/{args.rounds}, {schedule} m={microbatches}: bubble "
                      f"{measured:.3f} (stages {', '.join(f'{s:.3f}' for s in stages)}), theory "
                      f"{theory(microbatches):.3f}", flush=True)
    details = {"pipeline_bubble_setup": {
        "stages": STAGES, "forward_s": FORWARD_S, "backward_s": 2 * FORWARD_S, "width": WIDTH,
        "microbatch_rows": MICROBATCH_ROWS, "warmup_steps": WARMUP_STEPS, "steps": STEPS, "rounds": args.rounds,
        "per_stage_bubble_by_round": per_stage}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.pipeline_bubble", argv),
                  time.time() - started)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
