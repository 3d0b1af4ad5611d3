"""ZeRO's live reshard on a grow against writing and reading a checkpoint of the same state.

    .venv/bin/python -m benchmarks.zero_reshard            # 3 rounds of ZeRO-1 and ZeRO-3, about 40 s
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

The same again under ZeRO-3 (`FullyShardedModel`, FSDP2: the parameters move too, 12 bytes
per parameter, and the new generation's sharded module is built), keyed `zero3_reshard_s`,
`zero3_checkpoint_write_read_s` and `zero3_reshard_ratio_vs_checkpoint`.

At 2 ranks with buddy copies each old rank already holds the whole state, so the grow sends
only the newcomer's share (about 45 MB): the best case for a reshard. The baseline reads from
the page cache, the best case for a checkpoint.

The keys are merged into benchmarks/results/bench.json (or --out), keeping the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.bench import DEFAULT_OUT, command_line, merge_figures, print_medians
from elastic.techniques.fsdp import FullyShardedModel
from elastic.techniques.zero import ShardedOptimizer

WIDTH = 2048
LAYERS = 2  # 2 x (2048 x 2048 + 2048): 8.4 M parameters, 67 MB of AdamW state
PARAMETERS = LAYERS * (WIDTH * WIDTH + WIDTH)
DEFINITIONS = {
    "zero_reshard_s": "ZeRO-1 (AdamW, buddy copies) live reshard 2 -> 3 ranks of an 8.4 M-parameter model, slowest rank",
    "zero_checkpoint_write_read_s": "the same state written by 2 ranks (torch.save, fsync) and read back by 3 "
                                    "(torch.load, load_sharded), slowest rank of each, summed",
    "zero_reshard_ratio_vs_checkpoint": "zero_reshard_s over zero_checkpoint_write_read_s",
    "zero3_reshard_s": "ZeRO-3 (FSDP2, AdamW, buddy copies) live reshard 2 -> 3 ranks of the same model, slowest rank",
    "zero3_checkpoint_write_read_s": "the same ZeRO-3 state written by 2 ranks and read back by 3, as for ZeRO-1",
    "zero3_reshard_ratio_vs_checkpoint": "zero3_reshard_s over zero3_checkpoint_write_read_s",
}


class _Stage1:
    """ZeRO-1 behind the calls the measurement makes."""

    def __init__(self) -> None:
        self.model = _model()
        self.optimizer = ShardedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=1e-3))
        self.forward = self.model

    def lay_out(self, previous, steps: int) -> None:
        self.optimizer.reshard(previous)

    def load(self, pieces) -> None:
        self.optimizer.reshard(None)
        self.optimizer.load_sharded(pieces)

    @property
    def position(self):
        return self.optimizer.position

    def piece(self):
        return self.optimizer.sharded_state_dict()


class _Stage3:
    """ZeRO-3 on FSDP2 behind the same calls."""

    def __init__(self) -> None:
        self.sharded = FullyShardedModel(_model(), stage=3)
        self.optimizer = self.sharded.adopt(torch.optim.AdamW(self.sharded.module.parameters(), lr=1e-3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sharded.module(x)

    def lay_out(self, previous, steps: int) -> None:
        self.sharded.form(previous, steps=steps)

    def load(self, pieces) -> None:
        self.sharded.form(None, steps=0, pieces=pieces)

    @property
    def position(self):
        return self.sharded.position

    def piece(self):
        return self.sharded.sharded_state_dict()


STAGES = {1: _Stage1, 3: _Stage3}


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


def _member(process: int, port: int, folder: str, stage: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    held = STAGES[stage]()
    previous = None
    if process < 2:
        _join(store, 0, process, 2)
        held.lay_out(None, steps=0)
        held.forward(torch.randn(8, WIDTH)).square().mean().backward()
        held.optimizer.step()
        previous = held.position
        dist.barrier()
        started = time.perf_counter()
        path = os.path.join(folder, f"shard-{process}.pt")
        with open(path, "wb") as f:
            torch.save(held.piece(), f)
            f.flush()
            os.fsync(f.fileno())
        write_s = _slowest(time.perf_counter() - started)
    _join(store, 1, process, 3)
    dist.barrier()
    started = time.perf_counter()
    held.lay_out(previous, steps=1)
    reshard_s = _slowest(time.perf_counter() - started)
    # The baseline's read: fresh state over the same model, laid out over the three ranks.
    fresh = STAGES[stage]()
    dist.barrier()
    started = time.perf_counter()
    fresh.load([torch.load(os.path.join(folder, f"shard-{r}.pt"), weights_only=True) for r in range(2)])
    read_s = _slowest(time.perf_counter() - started)
    if process == 0:
        results["round"] = {"reshard_s": reshard_s, "write_s": write_s, "read_s": read_s}
    dist.destroy_process_group()


def measure_round(stage: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="elastic-zero-reshard-") as folder:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        results = mp.Manager().dict()
        mp.start_processes(_member, args=(store.port, folder, stage, results), nprocs=3, start_method="spawn")
        return dict(results["round"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.time()
    figures: dict[str, list[float | None]] = {}
    for round_index in range(args.rounds):
        for stage, prefix in ((1, "zero"), (3, "zero3")):
            outcome = measure_round(stage)
            baseline = outcome["write_s"] + outcome["read_s"]
            figures.setdefault(f"{prefix}_reshard_s", []).append(outcome["reshard_s"])
            figures.setdefault(f"{prefix}_checkpoint_write_read_s", []).append(baseline)
            figures.setdefault(f"{prefix}_reshard_ratio_vs_checkpoint", []).append(outcome["reshard_s"] / baseline)
            print(f"round {round_index + 1}/{args.rounds}, ZeRO-{stage}: reshard {outcome['reshard_s']:.3f} s; "
                  f"checkpoint write {outcome['write_s']:.3f} s + read {outcome['read_s']:.3f} s", flush=True)
    details = {"zero_reshard_setup": {"parameters": PARAMETERS, "state_bytes": 8 * PARAMETERS,
                                      "zero3_state_bytes": 12 * PARAMETERS, "rounds": args.rounds}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.zero_reshard", argv),
                  time.time() - started)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
