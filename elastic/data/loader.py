"""This rank's micro-batches of a step from a map-style dataset: which samples (from the
cursor), read and collated, in background threads ahead of the step when
`DataConfig(prefetch_threads>0)`, or in worker processes with `prefetch_processes>0` (as
torch's DataLoader workers: for datasets whose reads hold the GIL). `open_loader` picks this
or `elastic.data.stream.StreamLoader` (iterable datasets).

A prefetched step is keyed by everything that decides its samples: the cursor, the world
size and the rank. When a heal or a grow changes any of them, the batches prefetched for
the old key are dropped and the new key is read, from the cursor the generation synced, so
nothing is consumed twice and nothing is skipped.
"""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable

import torch
from ray import cloudpickle

from elastic.config import DataConfig
from elastic.data import order as data_math
from elastic.data.order import Loaded, micro_batches_of
from elastic.data.stream import StreamLoader
from elastic.errors import ElasticError

StepKey = tuple[int, int, int, int]  # epoch, consumed, world size, rank


def is_stream(dataset: Any) -> bool:
    """Iterable datasets are streamed (their epoch ends where they run dry, whatever a `__len__`
    says); everything else is indexed."""
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__"))


def open_loader(dataset: Any, config: DataConfig, pin_memory: bool = False) -> Loader | StreamLoader:
    """The loader for `dataset`: a stream's (`is_stream`), else an indexed one's."""
    if is_stream(dataset):
        return StreamLoader(dataset, config)
    return Loader(dataset, config, pin_memory)


def check_resumed_order(cursor: dict[str, int], config: DataConfig, checkpoint: str) -> None:
    """A run resumed inside a shuffled epoch trains the rest of that epoch's order, which the seed it
    was written with shuffled: another seed would train some of the epoch's samples twice and
    others never. At an epoch's start a new seed only orders the epochs to come."""
    seed = config.seed
    if config.shuffle and cursor.get("consumed", 0) > 0 and cursor.get("seed", seed) != seed:
        raise ElasticError(
            f"the checkpoint this run resumes from, {checkpoint}, stopped {cursor['consumed']} samples into epoch "
            f"{cursor.get('epoch', 0)} of the order DataConfig(seed={cursor['seed']}) shuffled, and this run asks "
            f"seed={seed}: the rest of the epoch would be another order, some samples trained twice and others "
            f"never. Resume with DataConfig(seed={cursor['seed']}), or use a new run name")


class Loader:
    """Reads the micro-batches of this rank's share of each step from a map-style dataset."""

    def __init__(self, dataset: Any, config: DataConfig, pin_memory: bool = False) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ElasticError(
                f"ctx.steps() needs a map-style dataset (with __len__ and __getitem__) or an iterable one (with "
                f"__iter__, state_dict and load_state_dict), got {type(dataset).__name__}; wrap the samples in a "
                "torch Dataset, or use elastic.ParquetDataset"
            )
        self.dataset = dataset
        self.config = config
        self.num_samples = len(dataset)
        if self.num_samples < config.global_batch_size:
            raise ElasticError(
                f"the dataset has {self.num_samples} samples, fewer than global_batch_size("
                f"{config.global_batch_size}); use a larger dataset or a smaller global batch"
            )
        blocks = getattr(dataset, "block_sizes", None)
        self._blocks = list(blocks) if blocks is not None else data_math.map_style_blocks(self.num_samples)
        if sum(self._blocks) != self.num_samples:
            raise ElasticError(f"{type(dataset).__name__}.block_sizes sum to {sum(self._blocks)}, but its len() is "
                               f"{self.num_samples}; the blocks must number every sample once")
        if getattr(dataset, "cache_rows", 0) is None:
            # A step's share spans the row groups of up to two windows: keep them all decoded.
            dataset.cache_rows = 2 * config.shuffle_window + max(self._blocks)
        self._orders: dict[int, data_math.EpochOrder] = {}
        ahead = config.prefetch_threads or config.prefetch_processes
        self._pin = pin_memory and ahead > 0  # on the train thread pinning is one more copy
        # With processes, each thread hands its reads to one worker process and waits (GIL free).
        self._pool = ThreadPoolExecutor(ahead, thread_name_prefix="elastic-prefetch") if ahead else None
        self._processes = None
        if config.prefetch_processes:
            try:
                # cloudpickle (Ray's): a dataset class defined inside the train loop travels by value.
                payload = cloudpickle.dumps(dataset)
            except Exception as exc:
                raise ElasticError(
                    f"DataConfig(prefetch_processes={config.prefetch_processes}) sends the dataset to worker "
                    f"processes, but {type(dataset).__name__} cannot be pickled ({type(exc).__name__}: {exc}); open "
                    "files and clients inside __getitem__, or use prefetch_threads"
                ) from exc
            self._processes = ProcessPoolExecutor(config.prefetch_processes,
                                                  mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_hold_dataset, initargs=(payload,))
        self._ahead: dict[StepKey, Future] = {}

    def settle(self, cursor: data_math.DataCursor) -> data_math.DataCursor:
        """The cursor of the step that starts at `cursor`: itself (`advance` already ended the epoch)."""
        return cursor

    def step_samples(self, cursor: data_math.DataCursor) -> int:
        if cursor.consumed >= self.num_samples:
            raise ElasticError(
                f"the data cursor is at sample {cursor.consumed} of epoch {cursor.epoch}, but the dataset has "
                f"{self.num_samples} samples: a run resumes with the dataset and DataConfig it was written with "
                "(seed, shuffle, shuffle_window); use a new run name for new data"
            )
        return cursor.step_samples(self.config.global_batch_size, self.num_samples)

    def advance(self, cursor: data_math.DataCursor) -> data_math.DataCursor:
        return cursor.advance(self.config.global_batch_size, self.num_samples, self.config.drop_last)

    def step(self, cursor: data_math.DataCursor, world_size: int, rank: int) -> list[Loaded]:
        """The micro-batches of rank's share of the step at `cursor`, and the next steps' reads started."""
        if self._pool is None:
            return self._read(cursor, world_size, rank)
        ready = self._ahead.pop((cursor.epoch, cursor.consumed, world_size, rank), None)
        upcoming, next_cursor = {}, cursor
        for _ in range(self.config.prefetch_steps):
            next_cursor = self.advance(next_cursor)
            upcoming[(next_cursor.epoch, next_cursor.consumed, world_size, rank)] = next_cursor
        for stale in set(self._ahead) - set(upcoming):
            self._ahead.pop(stale).cancel()
        for ahead, ahead_cursor in upcoming.items():
            if ahead not in self._ahead:
                self._ahead[ahead] = self._pool.submit(self._read, ahead_cursor, world_size, rank)
        return ready.result() if ready is not None else self._read(cursor, world_size, rank)

    def _read(self, cursor: data_math.DataCursor, world_size: int, rank: int) -> list[Loaded]:
        step_samples = self.step_samples(cursor)
        start, stop = data_math.step_positions(cursor, step_samples, world_size, rank)
        order = self._order(cursor.epoch)
        if start == stop:
            # The epoch's last step has fewer samples than ranks: this rank still joins the
            # gradient all-reduce, with a pass over one of the step's samples that weighs 0.
            return [Loaded(torch.empty(0, dtype=torch.int64), self._fetch(order.ids(cursor.consumed, cursor.consumed + 1)), 0)]
        ids = order.ids(start, stop)
        return micro_batches_of(ids, lambda a, b: self._fetch(ids[a:b]), self.config.micro_batch_size, step_samples,
                                world_size)

    def _fetch(self, ids: torch.Tensor) -> Any:
        if self._processes is not None:
            batch = self._processes.submit(_fetch_held, ids).result()
        else:
            batch = data_math.fetch(self.dataset, ids)
        return map_tensors(batch, torch.Tensor.pin_memory) if self._pin else batch

    def _order(self, epoch: int) -> data_math.EpochOrder:
        # Prefetch threads may ask for the next epoch while the train thread is in this one.
        order = self._orders.get(epoch)
        if order is None:
            cfg = self.config
            order = data_math.EpochOrder(self._blocks, epoch, cfg.seed, cfg.shuffle, cfg.shuffle_window)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1} | {epoch: order}
        return order

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.shutdown(wait=False, cancel_futures=True)


_held_dataset: Any = None  # in a prefetch worker process: the dataset it reads


def _hold_dataset(payload: bytes) -> None:
    global _held_dataset
    torch.set_num_threads(1)  # a reader, not a trainer: leave the cores to the training process
    _held_dataset = pickle.loads(payload)


def _fetch_held(ids: torch.Tensor) -> Any:
    return data_math.fetch(_held_dataset, ids)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`batch` with `fn` applied to every tensor in it (through dicts, lists, tuples and named tuples)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` on `device`; from pinned memory the copies overlap with compute."""
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))
