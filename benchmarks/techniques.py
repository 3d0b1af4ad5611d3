"""What each technique of `Strategy` costs and saves, against fp32 DDP in the same command.

    .venv/bin/python -m benchmarks.techniques            # 3 rounds, about 4 minutes
    .venv/bin/python -m benchmarks.techniques --quick    # 1 round
    .venv/bin/python -m benchmarks.techniques --quick --out /tmp/techniques.json

Run it from the repository root. Every variant trains the benchmark's workload
(benchmarks/workload.py: an MLP 256 -> 1024 -> 1024 -> 10, a global batch of 128) through
ElasticTrainer on 2 CPU workers of one local Ray instance, for STEPS steps without faults.
Each round runs every variant once, in turn, so the ratios compare runs made minutes apart.
Figures, per variant, each a median over the rounds with min, median and max under
`spread.<key>`:

- techniques.step_ratio_vs_ddp.<variant>: the median steady step time (rank 0's gaps between
  committed steps past WARMUP_STEPS) over fp32 DDP's in the same round. Every variant steps
  SGD, except the ZeRO variants, which step AdamW (ZeRO needs optimizer state to shard) and
  are set against DDP stepping AdamW;
- techniques.comm_bytes_per_step_ratio.<variant>: bytes each rank handed to the collectives
  that keep the replicas in step (`ctx.communication["sync_bytes"]`, counted in the gradient
  hook, or DDP's gradient bytes without one, or local SGD's syncs) per step, over fp32 DDP's;
- techniques.zero_state_over_formula.<stage>.<N>: the AdamW state bytes rank 0 holds under
  zero=<stage> at N workers over the formula 8Ψ/N (Ψ parameters, fp32 exp_avg and exp_avg_sq);
  `techniques_zero_state_bytes` has the bytes: own state, buddy copy, and under stages 2 and 3
  the parameter shard (formula 4Ψ/N).

The workload's labels are random, so its loss says nothing about a technique's accuracy; the
tests compare losses on a regression task instead (tests/test_techniques.py).

The keys are merged into benchmarks/results/bench.json (or --out), keeping the others.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

import ray
import torch

import elastic
from benchmarks import workload
from benchmarks.bench import DEFAULT_OUT, command_line, merge_figures, print_medians

STEPS = 120
QUICK_STEPS = 64  # multiples of the local SGD variants' H, so every interval ends in a sync
VARIANTS = {
    "ddp_fp32": elastic.Strategy(),
    "bf16": elastic.Strategy(precision="bf16"),
    "fp16": elastic.Strategy(precision="fp16"),
    "compress_fp16": elastic.Strategy(compression="fp16"),
    "compress_bf16": elastic.Strategy(compression="bf16"),
    "powersgd_r4": elastic.Strategy(compression="powersgd:rank=4,start_iter=2"),
    "zero1": elastic.Strategy(zero=1),
    "zero2": elastic.Strategy(zero=2),
    "zero3": elastic.Strategy(zero=3),
    "local_sgd_h8": elastic.Strategy(sync="local_sgd:every=8"),
    "diloco_h8": elastic.Strategy(sync="diloco:every=8"),
}
BASELINE = "ddp_fp32"
ZERO_WORLD_SIZES = (2, 3)
ZERO_STEPS = 8
DEFINITIONS = {
    "techniques.step_ratio_vs_ddp": "median steady step time of the variant over fp32 DDP's, same round, 2 CPU workers",
    "techniques.comm_bytes_per_step_ratio": "bytes per step a rank hands to the replicas' sync collectives, over fp32 DDP's",
    "techniques.zero_state_over_formula": "AdamW state bytes rank 0 holds under zero=<stage> at N workers over "
                                          "ZeRO's formula 8*P/N (P parameters, fp32 exp_avg and exp_avg_sq)",
}


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    ctx = elastic.get_context()
    dataset = workload.make_dataset()
    model = ctx.prepare_model(workload.make_model())
    if config.get("adamw"):
        optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        # Every variant but the ZeRO one steps plain SGD, as the other benchmarks do; ZeRO-1
        # needs state to shard, so it steps AdamW, and so does its own baseline run.
        inner = torch.optim.AdamW if ctx.strategy.zero else torch.optim.SGD
        optimizer = ctx.prepare_optimizer(inner(model.parameters(), lr=workload.LR))
    step_s = workload.train_elastic(ctx, model, optimizer, dataset)
    state_bytes = None
    if ctx.strategy.zero == 1:
        held = optimizer.state_bytes_per_rank()
        state_bytes = {"own": held.own, "buddy": held.buddy}
    elif ctx.strategy.zero:
        held = optimizer.state_bytes_per_rank()
        state_bytes = {"own": held["optimizer"], "buddy": held["buddy"], "params": held["params"]}
    return {"step_s": step_s,
            "sync_bytes_per_step": ctx.communication["sync_bytes"] / max(1, ctx.step),
            "state_bytes": state_bytes,
            "parameters": sum(p.numel() for p in model.parameters())}  # a DTensor counts its whole shape


def run_variant(strategy: elastic.Strategy, steps: int, storage: str, world_size: int = workload.WORLD_SIZE,
                **config: Any) -> dict[str, Any]:
    result = elastic.ElasticTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=elastic.ScalingConfig(min_workers=world_size, max_workers=world_size),
        run_config=elastic.RunConfig(name=f"techniques-{time.monotonic_ns()}", storage_path=storage),
        data_config=elastic.DataConfig(global_batch_size=workload.GLOBAL_BATCH, micro_batch_size=workload.MICRO_BATCH,
                                       max_steps=steps),
        strategy=strategy,
        show_progress=False,
    ).fit()
    return result.value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"one round of {QUICK_STEPS} steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rounds, steps = (1, QUICK_STEPS) if args.quick else (args.rounds, STEPS)
    started = time.time()
    ray.init(address="local", num_cpus=max(workload.WORLD_SIZE, *ZERO_WORLD_SIZES), include_dashboard=False,
             log_to_driver=False)
    figures: dict[str, list[float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="elastic-techniques-") as storage:
        # Workers cannot import `benchmarks`: ship the train loop and the workload by value.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        ray.cloudpickle.register_pickle_by_value(workload)
        for round_index in range(rounds):
            outcomes = {name: run_variant(strategy, steps, storage) for name, strategy in VARIANTS.items()}
            base = outcomes[BASELINE]
            adamw = run_variant(elastic.Strategy(), steps, storage, adamw=True)
            for stage in (1, 2, 3):
                zero = outcomes.pop(f"zero{stage}")
                figures.setdefault(f"techniques.step_ratio_vs_ddp.zero{stage}", []).append(
                    zero["step_s"] / adamw["step_s"] if zero["step_s"] and adamw["step_s"] else None)
            for name, outcome in outcomes.items():
                figures.setdefault(f"techniques.step_ratio_vs_ddp.{name}", []).append(
                    outcome["step_s"] / base["step_s"] if outcome["step_s"] and base["step_s"] else None)
                figures.setdefault(f"techniques.comm_bytes_per_step_ratio.{name}", []).append(
                    outcome["sync_bytes_per_step"] / base["sync_bytes_per_step"])
            print(f"round {round_index + 1}/{rounds}: " + ", ".join(
                f"{n} {o['step_s'] * 1e3:.1f} ms" for n, o in outcomes.items() if o["step_s"]), flush=True)
        zero_state = {}
        for stage in (1, 2, 3):
            for world_size in ZERO_WORLD_SIZES:
                outcome = run_variant(VARIANTS[f"zero{stage}"], ZERO_STEPS, storage, world_size=world_size)
                formula = 8 * outcome["parameters"] / world_size
                zero_state[f"zero{stage}.{world_size}"] = {**outcome["state_bytes"], "formula_each": formula,
                                                           "own_over_formula": outcome["state_bytes"]["own"] / formula,
                                                           "replicated": 8 * outcome["parameters"]}
                figures[f"techniques.zero_state_over_formula.zero{stage}.{world_size}"] = [
                    outcome["state_bytes"]["own"] / formula]
    ray.shutdown()
    command = command_line("benchmarks.techniques", argv)
    details = {"techniques_setup": {"steps": steps, "rounds": rounds, "world_size": workload.WORLD_SIZE,
                                    "variants": {name: s.model_dump() for name, s in VARIANTS.items()}},
               "techniques_zero_state_bytes": zero_state}
    merge_figures(args.out, figures, details, DEFINITIONS, command, time.time() - started)
    print("ZeRO AdamW state bytes per rank:", zero_state)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
