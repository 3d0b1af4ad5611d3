"""The loss of every technique against fp32 DDP on the demo's language model, through a heal
and a grow, in one plot.

    .venv/bin/python -m benchmarks.loss_curves            # about 3 minutes
    .venv/bin/python -m benchmarks.loss_curves --steps 60 --out /tmp/loss.json --png /tmp/loss.png

Run it from the repository root. Each variant is the demo (`elastic demo`: a small
transformer on byte windows of Python's standard library, 2 to 3 CPU workers, rank 1 killed a
quarter into the run, a replacement growing the run back) with one `Strategy`, all with the
same seed and data order. It draws every run's loss over its committed steps with
`elastic plot --compare` into benchmarks/results/loss_curves.png, and merges into
benchmarks/results/bench.json (or --out):

- techniques.lm_final_loss_ratio_vs_fp32.<variant>: the mean of the run's last LAST_LOSSES
  reported losses over fp32 DDP's. The journal samples the loss about every 2 s, one step's
  loss on rank 0's share each, so the samples fall on different steps for each variant: the
  ratios carry a few percent of that noise. One round; the tests hold the exact equivalences.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import ray

from benchmarks.bench import DEFAULT_OUT, command_line, merge_figures
from elastic.checkpoint.storage import RunStorage
from elastic.config import Strategy
from elastic.demo.train import DemoConfig, default_fault, run_demo
from elastic.journal.events import read_events
from elastic.journal.timeline import draw_comparison, loss_by_step

STEPS = 160
LAST_LOSSES = 3
DEFAULT_PNG = os.path.join(os.path.dirname(DEFAULT_OUT), "loss_curves.png")
VARIANTS = {
    "fp32": Strategy(),
    "bf16": Strategy(precision="bf16"),
    "fp16": Strategy(precision="fp16"),
    "compress_bf16": Strategy(compression="bf16"),
    "powersgd_r4": Strategy(compression="powersgd:rank=4,start_iter=10"),
    "zero1": Strategy(zero=1),
    "zero3": Strategy(zero=3),
    "local_sgd_h8": Strategy(sync="local_sgd:every=8"),
    "diloco_h8": Strategy(sync="diloco:every=8"),
}
DEFINITIONS = {
    "techniques.lm_final_loss_ratio_vs_fp32": "the demo LM's mean last reported losses under the variant over fp32 "
                                              "DDP's, each run healing a kill and growing back",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--png", default=DEFAULT_PNG)
    args = parser.parse_args(argv)
    started = time.time()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="elastic-loss-curves-") as storage:
        for name, strategy in VARIANTS.items():
            config = DemoConfig(name=f"lm-{name}", storage_path=storage, steps=args.steps, strategy=strategy,
                                checkpoint_every=args.steps, faults=[default_fault(args.steps)])
            summary = run_demo(config, show_progress=False)
            runs[f"lm-{name}"] = read_events(RunStorage(storage, f"lm-{name}"))
            sizes = [entry["world_size"] for entry in summary["world_size_history"]]
            print(f"{name}: {summary['steps']} steps, world sizes {sizes}", flush=True)
        ray.shutdown()
        last = {name: statistics.mean(loss_by_step(events)[1][-LAST_LOSSES:]) for name, events in runs.items()}
        draw_comparison(runs, args.png)
    reference = last["lm-fp32"]
    figures = {f"techniques.lm_final_loss_ratio_vs_fp32.{name[3:]}": [loss / reference]
               for name, loss in last.items() if name != "lm-fp32"}
    details = {"loss_curves_setup": {"steps": args.steps, "last_losses": LAST_LOSSES, "png": args.png,
                                     "final_loss": last}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.loss_curves", argv),
                  time.time() - started)
    for name, loss in last.items():
        print(f"{name:20s} last loss {loss:.4f}  ratio {loss / reference:.3f}")
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
