"""A streaming map-style dataset over Parquet files, through `pyarrow.dataset` and any `pyarrow.fs`.

Only the files' footers are read up front. The samples are numbered in file order, and each
row group is one block of the epoch order (`elastic.data.EpochOrder`): a step reads only the
row groups its samples are in, and keeps the most recently read ones up to `cache_rows` rows,
so a worker's memory is bounded by the shuffle window, not by the size of the data set.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import torch

# Two of DataConfig's default shuffle windows: a step may straddle two windows.
DEFAULT_CACHE_ROWS = 2 * 262_144


class ParquetDataset:
    """Samples of Parquet files: numeric columns become 1-d tensors, fixed-length list
    columns (e.g. token windows) 2-d tensors. `source` is a folder, a file or a list of files,
    as `pyarrow.dataset.dataset` takes them; `filesystem` any `pyarrow.fs.FileSystem`."""

    def __init__(
        self,
        source: str | Sequence[str],
        columns: Sequence[str] | None = None,
        filesystem: pafs.FileSystem | None = None,
        cache_rows: int = DEFAULT_CACHE_ROWS,
    ) -> None:
        dataset = pads.dataset(source, format="parquet", filesystem=filesystem)
        self.columns = list(columns) if columns is not None else dataset.schema.names
        self._row_groups = [
            group for fragment in dataset.get_fragments() for group in fragment.split_by_row_group()
            if group.row_groups[0].num_rows > 0
        ]
        if not self._row_groups:
            raise ValueError(f"ParquetDataset({source!r}) has no rows; point it at non-empty Parquet files")
        self.block_sizes = [group.row_groups[0].num_rows for group in self._row_groups]
        sizes = torch.tensor(self.block_sizes, dtype=torch.int64)
        self._first_ids = torch.cumsum(sizes, 0) - sizes
        self.cache_rows = cache_rows
        self._cache: OrderedDict[int, pa.Table] = OrderedDict()
        self._lock = threading.Lock()
        self.row_groups_read = 0

    def __len__(self) -> int:
        return int(self._first_ids[-1]) + self.block_sizes[-1]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([index]).items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        ids = torch.as_tensor(indices, dtype=torch.int64)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(self)):
            raise IndexError(f"sample ids must be in [0, {len(self)}), got {indices[:8]}")
        blocks = torch.searchsorted(self._first_ids, ids, right=True) - 1
        order = torch.argsort(blocks, stable=True)
        parts = []
        for block in torch.unique(blocks).tolist():
            rows = ids[blocks == block] - self._first_ids[block]
            parts.append(self._block(block).take(pa.array(rows.numpy())))
        # The parts follow the blocks' order; put the rows back in the order they were asked for.
        rows = pa.concat_tables(parts).take(pa.array(torch.argsort(order).numpy()))
        return {name: _column_tensor(rows.column(name)) for name in self.columns}

    def _block(self, block: int) -> pa.Table:
        with self._lock:
            if block in self._cache:
                self._cache.move_to_end(block)
                return self._cache[block]
        # Read outside the lock: pyarrow releases the GIL, so prefetch threads read in parallel.
        table = self._row_groups[block].to_table(columns=self.columns)
        with self._lock:
            self.row_groups_read += 1
            self._cache[block] = table
            held = sum(t.num_rows for t in self._cache.values())
            while held > self.cache_rows and len(self._cache) > 1:
                held -= self._cache.popitem(last=False)[1].num_rows
        return table

    def __getstate__(self) -> dict:
        # The cache and the lock stay behind: a copy sent to a worker reads afresh.
        return {**self.__dict__, "_cache": OrderedDict(), "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


def _column_tensor(column: pa.ChunkedArray) -> torch.Tensor:
    array = column.combine_chunks()
    if pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type):
        values = array.flatten().to_numpy(zero_copy_only=False)
        return torch.from_numpy(values.reshape(len(array), -1).copy())
    return torch.from_numpy(array.to_numpy(zero_copy_only=False).copy())
