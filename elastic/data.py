"""The global data cursor and the batch split that make data exactly-once at any world size.

One cursor (epoch, samples consumed in the epoch, seed) describes where the whole run is in
its data. Each optimizer step takes the next `global_batch_size` positions of the epoch's
permutation; rank r of W takes a contiguous share of those positions, as even as the division
allows; a share is cut into micro-batches of at most `micro_batch_size`. Because the cursor is
part of the synced state and only moves when a step commits, no sample of an epoch is lost or
seen twice across any rescale. Everything here is pure and needs no Ray.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import torch
from torch.utils.data import TensorDataset, default_collate


@dataclass(frozen=True)
class DataCursor:
    """Where the run is in its data; moves only when an optimizer step commits."""

    epoch: int = 0
    consumed: int = 0
    seed: int = 0

    def advance(self, global_batch_size: int, num_samples: int) -> "DataCursor":
        """The cursor after one committed step; an epoch ends when less than a global batch is left."""
        consumed = self.consumed + global_batch_size
        if consumed + global_batch_size > num_samples:
            return DataCursor(self.epoch + 1, 0, self.seed)
        return DataCursor(self.epoch, consumed, self.seed)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The order in which an epoch visits the samples; identical on every rank."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def share_bounds(global_batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's share of a global batch; the first `remainder` ranks get one more."""
    base, remainder = divmod(global_batch_size, world_size)
    start = rank * base + min(rank, remainder)
    return start, start + base + (1 if rank < remainder else 0)


def micro_bounds(share: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch of a share."""
    return [(s, min(s + micro_batch_size, share)) for s in range(0, share, micro_batch_size)]


def gradient_weight(samples: int, world_size: int, global_batch_size: int) -> float:
    """Factor for a micro-batch's mean loss so that DDP's average equals the global-batch mean.

    DDP divides the summed gradient by the world size, so a micro-batch of n samples must weigh
    n * W / G for the result to be the mean over all G samples, however unevenly they split.
    """
    return samples * world_size / global_batch_size


def step_indices(
    cursor: DataCursor, order: torch.Tensor, global_batch_size: int, world_size: int, rank: int
) -> torch.Tensor:
    """Sample indices of rank's share of the step that starts at `cursor`."""
    start, stop = share_bounds(global_batch_size, world_size, rank)
    return order[cursor.consumed + start : cursor.consumed + stop]


def fetch(dataset: Any, indices: torch.Tensor) -> Any:
    """Collate the samples at `indices`, using the dataset's batched access when it has one."""
    if isinstance(dataset, TensorDataset):
        return tuple(t[indices] for t in dataset.tensors)
    if hasattr(dataset, "__getitems__"):
        return dataset.__getitems__(indices.tolist())
    return default_collate([dataset[i] for i in indices.tolist()])


class ParquetDataset:
    """A map-style dataset over Parquet files, read through pyarrow (any `pyarrow.fs`).

    Numeric columns become 1-d tensors; fixed-length list columns (e.g. token windows) become
    2-d tensors. The table is held in memory, which suits data sets that fit a worker.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        columns: Sequence[str] | None = None,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        self.table = pads.dataset(source, format="parquet", filesystem=filesystem).to_table(columns=columns)
        if self.table.num_rows == 0:
            raise ValueError(f"ParquetDataset({source!r}) has no rows; point it at non-empty Parquet files")

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([index]).items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        rows = self.table.take(pa.array(indices, type=pa.int64()))
        return {name: _column_tensor(rows.column(name)) for name in rows.column_names}


def _column_tensor(column: pa.ChunkedArray) -> torch.Tensor:
    array = column.combine_chunks()
    if pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type):
        values = array.flatten().to_numpy(zero_copy_only=False)
        return torch.from_numpy(values.reshape(len(array), -1).copy())
    return torch.from_numpy(array.to_numpy(zero_copy_only=False).copy())
