"""The data path: the streaming loader against a bare pyarrow scan, prefetch against a slow
data set, and a worker's memory as the data set grows.

    .venv/bin/python -m benchmarks.data            # 3 rounds, about 3 minutes
    .venv/bin/python -m benchmarks.data --quick    # 1 round
    .venv/bin/python -m benchmarks.data --quick --out /tmp/data.json

Run it from the repository root. Figures, each a median over the rounds with min, median and
max under `spread.<key>`:

- loader_samples_s_ratio_vs_pyarrow: samples per second of one rank's `elastic.data.loader.Loader`
  over an `elastic.ParquetDataset` (shuffled: blocks and windows, world size 1, a global batch
  of 256) through one epoch of Parquet files of 256-byte token windows, over a bare
  `pyarrow.dataset` scan of the same files in file order, each batch turned into a tensor the
  same way. Both read from the page cache, one after the other, in a fresh process with
  OMP_NUM_THREADS=1, as in a Ray worker of one CPU (pyarrow and torch size their thread pools
  from it);
- step_ratio_slow_dataset_prefetch: the median steady step time of ElasticTrainer on 2 CPU
  workers (benchmarks/workload.py's MLP) whose data set sleeps SLOW_FETCH_S in every fetch,
  with DataConfig(prefetch_threads=2), over the same run on the in-memory data set (a sleep
  releases the GIL, as a read from storage does);
  step_ratio_slow_dataset_no_prefetch the same without prefetch; prefetch_hidden_fraction is
  the share of the data time prefetch took off the step: (slow - prefetched) / (slow - in memory);
- worker_peak_rss_mb.1x and .10x: the peak resident memory of a fresh process that reads one
  epoch through the same loader (prefetch_threads=1) over ROWS and 10 x ROWS rows, with
  DataConfig's shuffle window at WINDOW rows (the loader sizes the dataset's cache to two windows
  and a row group);
  worker_peak_rss_ratio_10x_vs_1x their ratio; worker_rss_before_read_mb what that process
  holds once its imports are done, before it reads (most of the peak is torch's and pyarrow's
  libraries).

The keys are merged into benchmarks/results/bench.json (or --out), keeping the others.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import ray
import torch

import elastic
from benchmarks import workload
from benchmarks.bench import DEFAULT_OUT, command_line, merge_figures, print_medians
from elastic.data.loader import Loader
from elastic.data.order import DataCursor
from elastic.data.parquet import _column_array

ROWS = 131_072
TOKENS = 256
ROW_GROUP = 4096
WINDOW = 16_384
LOADER_BATCH = 256
SLOW_FETCH_S = 0.015
STEPS = 100
QUICK_STEPS = 60
DEFINITIONS = {
    "loader_samples_s_ratio_vs_pyarrow": "one rank's shuffled streaming loader over a bare in-order pyarrow scan "
                                         "of the same Parquet files, samples per second",
    "step_ratio_slow_dataset_prefetch": "median steady step with a data set that sleeps in every fetch and "
                                        "prefetch_threads=2, over the step on in-memory data; 2 CPU workers",
    "step_ratio_slow_dataset_no_prefetch": "the same slow data set without prefetch, over in-memory data",
    "prefetch_hidden_fraction": "(slow step - prefetched step) / (slow step - in-memory step)",
    "worker_peak_rss_mb": "peak RSS of a fresh process reading one epoch through the loader, at 1x and 10x rows",
    "worker_peak_rss_ratio_10x_vs_1x": "worker_peak_rss_mb at 10x rows over 1x",
    "worker_rss_before_read_mb": "RSS of that process once torch, pyarrow and elastic are imported, before reading",
}


def write_corpus(folder: str, rows: int) -> None:
    """Random 256-byte token windows in Parquet files of 8 row groups each."""
    os.makedirs(folder, exist_ok=True)
    generator = numpy.random.default_rng(0)
    per_file = ROW_GROUP * 8
    for index, start in enumerate(range(0, rows, per_file)):
        count = min(per_file, rows - start)
        tokens = generator.integers(0, 256, count * TOKENS, dtype=numpy.uint8)
        table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens), TOKENS)})
        pq.write_table(table, os.path.join(folder, f"part-{index:04d}.parquet"), row_group_size=ROW_GROUP)


def loader_config(steps: int = 1, prefetch_threads: int = 0) -> elastic.DataConfig:
    return elastic.DataConfig(global_batch_size=LOADER_BATCH, micro_batch_size=LOADER_BATCH, max_steps=steps,
                              shuffle_window=WINDOW, prefetch_threads=prefetch_threads)


def read_epoch(folder: str, prefetch_threads: int = 0) -> int:
    """Samples one rank at world size 1 reads in an epoch through the loader."""
    dataset = elastic.ParquetDataset(folder)
    loader = Loader(dataset, loader_config(prefetch_threads=prefetch_threads))
    cursor, samples = DataCursor(), 0
    while cursor.epoch == 0:
        samples += sum(micro.samples for micro in loader.step(cursor, 1, 0))
        cursor = loader.advance(cursor)
    loader.close()
    return samples


def bare_scan(folder: str) -> int:
    samples = 0
    for batch in pads.dataset(folder, format="parquet").to_batches(batch_size=LOADER_BATCH):
        samples += len(torch.from_numpy(_column_array("tokens", pa.chunked_array([batch.column(0)])).copy()))
    return samples


def samples_per_s(read, folder: str) -> float:
    started = time.perf_counter()
    samples = read(folder)
    return samples / (time.perf_counter() - started)


class SlowDataset(torch.utils.data.Dataset):
    """The workload's samples, with every fetch sleeping like a remote read."""

    def __init__(self) -> None:
        self.inner = workload.make_dataset()

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        return self.inner[index]

    def __getitems__(self, indices: list[int]):
        time.sleep(SLOW_FETCH_S)
        return tuple(t[torch.as_tensor(indices)] for t in self.inner.tensors)


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    ctx = elastic.get_context()
    dataset = SlowDataset() if config["slow"] else workload.make_dataset()
    model = ctx.prepare_model(workload.make_model())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=workload.LR))
    return {"step_s": workload.train_elastic(ctx, model, optimizer, dataset)}


def step_s(storage: str, steps: int, slow: bool, prefetch_threads: int) -> float | None:
    result = elastic.ElasticTrainer(
        train_loop,
        train_loop_config={"slow": slow},
        scaling_config=elastic.ScalingConfig(min_workers=workload.WORLD_SIZE, max_workers=workload.WORLD_SIZE),
        run_config=elastic.RunConfig(name=f"data-{time.monotonic_ns()}", storage_path=storage),
        data_config=elastic.DataConfig(global_batch_size=workload.GLOBAL_BATCH, micro_batch_size=workload.MICRO_BATCH,
                                       max_steps=steps, prefetch_threads=prefetch_threads),
        show_progress=False,
    ).fit()
    return result.value["step_s"]


def throughput(folder: str) -> dict[str, float]:
    """Samples per second of the bare scan and of the loader, measured in a fresh process
    with one CPU thread, as a Ray worker with num_cpus=1 has."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.data", "--child-throughput", folder], check=True,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    return json.loads(out.strip().splitlines()[-1])


def peak_rss_mb(folder: str) -> dict[str, float]:
    """A fresh process's RSS once torch and pyarrow are imported, and its peak after reading
    one epoch of `folder` through the loader."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.data", "--child-rss", folder],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"one round of {QUICK_STEPS} steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--child-rss", help=argparse.SUPPRESS)
    parser.add_argument("--child-throughput", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_throughput:
        read_epoch(args.child_throughput)  # both read from the page cache
        print(json.dumps({"scan": samples_per_s(bare_scan, args.child_throughput),
                          "loader": samples_per_s(read_epoch, args.child_throughput)}))
        return 0
    if args.child_rss:
        before = _current_rss_mb()
        samples = read_epoch(args.child_rss, prefetch_threads=1)
        print(json.dumps({"samples": samples, "before_read_mb": before,
                          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return 0
    rounds, steps = (1, QUICK_STEPS) if args.quick else (args.rounds, STEPS)
    started = time.time()
    figures: dict[str, list[float | None]] = {}

    def add(key: str, value: float | None) -> None:
        figures.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory(prefix="elastic-data-") as scratch:
        small, large = os.path.join(scratch, "1x"), os.path.join(scratch, "10x")
        write_corpus(small, ROWS)
        write_corpus(large, 10 * ROWS)
        for round_index in range(rounds):
            rates = throughput(small)
            scan, loader = rates["scan"], rates["loader"]
            add("loader_samples_s_ratio_vs_pyarrow", loader / scan)
            rss_small, rss_large = peak_rss_mb(small), peak_rss_mb(large)
            add("worker_peak_rss_mb.1x", rss_small["peak_rss_mb"])
            add("worker_peak_rss_mb.10x", rss_large["peak_rss_mb"])
            add("worker_peak_rss_ratio_10x_vs_1x", rss_large["peak_rss_mb"] / rss_small["peak_rss_mb"])
            add("worker_rss_before_read_mb", rss_small["before_read_mb"])
            print(f"round {round_index + 1}/{rounds}: loader {loader:,.0f} samples/s, scan {scan:,.0f}; peak RSS "
                  f"{rss_small['peak_rss_mb']:.0f} MB at 1x, {rss_large['peak_rss_mb']:.0f} MB at 10x, "
                  f"{rss_small['before_read_mb']:.0f} MB before reading", flush=True)

    ray.init(address="local", num_cpus=workload.WORLD_SIZE, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(workload)
    with tempfile.TemporaryDirectory(prefix="elastic-data-runs-") as storage:
        for round_index in range(rounds):
            memory = step_s(storage, steps, slow=False, prefetch_threads=0)
            slow = step_s(storage, steps, slow=True, prefetch_threads=0)
            prefetched = step_s(storage, steps, slow=True, prefetch_threads=2)
            add("step_ratio_slow_dataset_prefetch", _ratio(prefetched, memory))
            add("step_ratio_slow_dataset_no_prefetch", _ratio(slow, memory))
            add("prefetch_hidden_fraction", (slow - prefetched) / (slow - memory)
                if None not in (slow, prefetched, memory) and slow > memory else None)
            print(f"round {round_index + 1}/{rounds}: step {memory * 1e3:.1f} ms in memory, {slow * 1e3:.1f} ms "
                  f"slow, {prefetched * 1e3:.1f} ms slow with prefetch", flush=True)
    ray.shutdown()
    details = {"data_setup": {"rows": ROWS, "tokens": TOKENS, "row_group": ROW_GROUP, "window": WINDOW,
                              "loader_batch": LOADER_BATCH, "slow_fetch_s": SLOW_FETCH_S, "steps": steps,
                              "rounds": rounds, "world_size": workload.WORLD_SIZE}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.data", argv), time.time() - started)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
