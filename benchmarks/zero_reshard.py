"""ZeRO-1's live reshard on a grow against writing and reading a checkpoint of the same state.

    .venv/bin/python -m benchmarks.zero_reshard            # 3 rounds, about 20 s
    .venv/bin/python -m benchmarks.zero_reshard --rounds 1 --out /tmp/zero.json

Run it from the repository root. Three processes on this machine form real gloo groups, as
tests/test_zero.py does: two train a model of PARAMETERS float32 parameters with
`ShardedOptimizer(AdamW)` for one step (so the AdamW state exists: 8 bytes per parameter,
each rank's shard also kept by its buddy), then the third joins and all three call
`reshard` (each rank receives, point to point, the slices of the new layout it lacks). The
baseline moves the same state through storage instead: each of the two ranks writes its
`sharded_state_dict()` to a file on local disk (`torch.save`, fsynced), and each of the
three new ranks reads them back and rebuilds its shard with `load_sharded`. Figures, each a
median over the rounds with min, median and max under `spread.<key>`, all the slowest
rank's time:

- zero_reshard_s: the live 2 -> 3 reshard;
- zero_checkpoint_write_read_s: the write plus the read of the baseline;
- zero_reshard_ratio_vs_checkpoint: their ratio.

At 2 ranks with buddy copies each old rank already holds the whole state, so the grow sends
only the newcomer's share (about 45 MB): the best case for a reshard. The baseline reads from
the page cache, the best case for a checkpoint.

The keys are merged into benchmarks/results/bench.json (or --out), keeping the others.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.bench import DEFAULT_OUT, command_line, merge_figures
from elastic.zero import ShardedOptimizer

WIDTH = 2048
LAYERS = 2  # 2 x (2048 x 2048 + 2048): 8.4 M parameters, 67 MB of AdamW state
PARAMETERS = LAYERS * (WIDTH * WIDTH + WIDTH)
DEFINITIONS = {
    "zero_reshard_s": "ZeRO-1 (AdamW, buddy copies) live reshard 2 -> 3 ranks of an 8.4 M-parameter model, slowest rank",
    "zero_checkpoint_write_read_s": "the same state written by 2 ranks (torch.save, fsync) and read back by 3 "
                                    "(torch.load, load_sharded), slowest rank of each, summed",
    "zero_reshard_ratio_vs_checkpoint": "zero_reshard_s over zero_checkpoint_write_read_s",
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _join(store: dist.TCPStore, generation: int, rank: int, world_size: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _member(process: int, port: int, folder: str, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    model = _model()
    optimizer = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    previous = None
    if process < 2:
        _join(store, 0, process, 2)
        optimizer.reshard(None)
        model(torch.randn(8, WIDTH)).square().mean().backward()
        optimizer.step()
        previous = optimizer.position
        dist.barrier()
        started = time.perf_counter()
        path = os.path.join(folder, f"shard-{process}.pt")
        with open(path, "wb") as f:
            torch.save(optimizer.sharded_state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        write_s = _slowest(time.perf_counter() - started)
    _join(store, 1, process, 3)
    dist.barrier()
    started = time.perf_counter()
    optimizer.reshard(previous)
    reshard_s = _slowest(time.perf_counter() - started)
    # The baseline's read: a fresh optimizer over the same model, laid out over the three ranks.
    fresh = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    fresh.reshard(None)
    dist.barrier()
    started = time.perf_counter()
    fresh.load_sharded([torch.load(os.path.join(folder, f"shard-{r}.pt"), weights_only=True) for r in range(2)])
    read_s = _slowest(time.perf_counter() - started)
    if process == 0:
        results["round"] = {"reshard_s": reshard_s, "write_s": write_s, "read_s": read_s}
    dist.destroy_process_group()


def measure_round() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="elastic-zero-reshard-") as folder:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        results = mp.Manager().dict()
        mp.start_processes(_member, args=(store.port, folder, results), nprocs=3, start_method="spawn")
        return dict(results["round"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.time()
    figures: dict[str, list[float | None]] = {}
    for round_index in range(args.rounds):
        outcome = measure_round()
        baseline = outcome["write_s"] + outcome["read_s"]
        figures.setdefault("zero_reshard_s", []).append(outcome["reshard_s"])
        figures.setdefault("zero_checkpoint_write_read_s", []).append(baseline)
        figures.setdefault("zero_reshard_ratio_vs_checkpoint", []).append(outcome["reshard_s"] / baseline)
        print(f"round {round_index + 1}/{args.rounds}: reshard {outcome['reshard_s']:.3f} s; checkpoint write "
              f"{outcome['write_s']:.3f} s + read {outcome['read_s']:.3f} s", flush=True)
    details = {"zero_reshard_setup": {"parameters": PARAMETERS, "state_bytes": 8 * PARAMETERS,
                                      "rounds": args.rounds}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.zero_reshard", argv),
                  time.time() - started)
    for key, values in sorted(figures.items()):
        print(f"{key:40s} {statistics.median(values):.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
