"""A streaming map-style dataset over Parquet files, through `pyarrow.dataset` and any `pyarrow.fs`.

Only the files' footers are read up front. The samples are numbered in file order, and each
row group is one block of the epoch order (`elastic.data.EpochOrder`): a step reads only the
row groups its samples are in, and keeps the most recently read ones up to `cache_rows` rows
(by default the loader makes that two shuffle windows and a row group), so a worker's memory
is bounded by the shuffle window, not by the size of the data set.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import numpy
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import torch

class ParquetDataset:
    """Samples of Parquet files: numeric columns become 1-d tensors, list columns whose rows
    all have one length (e.g. token windows) 2-d tensors. `source` is a folder, a file or a
    list of files, as `pyarrow.dataset.dataset` takes them; `filesystem` any
    `pyarrow.fs.FileSystem`. Files are read with the data set's unified schema."""

    def __init__(
        self,
        source: str | Sequence[str],
        columns: Sequence[str] | None = None,
        filesystem: pafs.FileSystem | None = None,
        cache_rows: int | None = None,
    ) -> None:
        dataset = pads.dataset(source, format="parquet", filesystem=filesystem)
        self._schema = dataset.schema
        self.columns = list(columns) if columns is not None else dataset.schema.names
        for name in self.columns:
            _check_column(name, self._schema)
        self._row_groups = [
            group for fragment in dataset.get_fragments() for group in fragment.split_by_row_group()
            if group.row_groups[0].num_rows > 0
        ]
        if not self._row_groups:
            raise ValueError(f"ParquetDataset({source!r}) has no rows; point it at non-empty Parquet files")
        self.block_sizes = [group.row_groups[0].num_rows for group in self._row_groups]
        sizes = numpy.asarray(self.block_sizes, dtype=numpy.int64)
        self._first_ids = numpy.cumsum(sizes) - sizes
        self.cache_rows = cache_rows  # None: the loader sets it from DataConfig.shuffle_window
        self._cache: OrderedDict[int, pa.Table] = OrderedDict()
        self._lock = threading.Lock()
        self._reading: dict[int, threading.Event] = {}  # row groups being read, by block
        self.row_groups_read = 0

    def __len__(self) -> int:
        return int(self._first_ids[-1]) + self.block_sizes[-1]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([index]).items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        ids = numpy.asarray(indices, dtype=numpy.int64)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(self)):
            raise IndexError(f"sample ids must be in [0, {len(self)}), got {indices[:8]}")
        blocks = numpy.searchsorted(self._first_ids, ids, side="right") - 1
        order = numpy.argsort(blocks, kind="stable")
        parts = [self._block(int(block)).take(ids[order[start:stop]] - self._first_ids[block])
                 for block, start, stop in _runs(blocks[order])]
        # The parts follow the blocks' order; put the rows back in the order they were asked for.
        rows = pa.concat_tables(parts).take(numpy.argsort(order))
        return {name: _column_tensor(name, rows.column(name)) for name in self.columns}

    def _block(self, block: int) -> pa.Table:
        while True:
            with self._lock:
                if block in self._cache:
                    self._cache.move_to_end(block)
                    return self._cache[block]
                reading = self._reading.get(block)
                if reading is None:
                    reading = self._reading[block] = threading.Event()
                    break
            reading.wait()  # another thread reads this row group: take its copy, never read twice
        try:
            # Read outside the lock: pyarrow releases the GIL, so prefetch threads read in parallel.
            table = self._row_groups[block].to_table(columns=self.columns, schema=self._schema)
            with self._lock:
                self.row_groups_read += 1
                self._cache[block] = table
                held = sum(t.num_rows for t in self._cache.values())
                while self.cache_rows is not None and held > self.cache_rows and len(self._cache) > 1:
                    held -= self._cache.popitem(last=False)[1].num_rows
        finally:
            with self._lock:
                del self._reading[block]
            reading.set()
        return table

    def __getstate__(self) -> dict:
        # The cache and the lock stay behind: a copy sent to a worker reads afresh.
        return {**self.__dict__, "_cache": OrderedDict(), "_lock": None, "_reading": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


def _runs(values: numpy.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, stop) of each run of equal values in sorted `values`."""
    starts = numpy.flatnonzero(numpy.diff(values, prepend=-1))
    stops = numpy.append(starts[1:], len(values))
    return [(int(values[a]), int(a), int(b)) for a, b in zip(starts, stops)]


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _check_column(name: str, schema: pa.Schema) -> None:
    if name not in schema.names:
        raise ValueError(f"ParquetDataset: no column {name!r}; the files have {schema.names}")
    kind = schema.field(name).type
    if not (_is_number(kind) or (_is_list(kind) and _is_number(kind.value_type))):
        raise ValueError(
            f"ParquetDataset: column {name!r} is {kind}, which is not a tensor: only numbers, booleans and lists of "
            f"them are read; pass columns=[...] without it (the tensor columns are "
            f"{[n for n in schema.names if _is_number(schema.field(n).type) or _is_list(schema.field(n).type)]})"
        )


def _column_tensor(name: str, column: pa.ChunkedArray) -> torch.Tensor:
    array = column.combine_chunks()
    if array.null_count:
        raise ValueError(f"ParquetDataset: column {name!r} has {array.null_count} nulls among the rows read; "
                         "fill them in the files, or pass columns=[...] without it")
    if _is_list(array.type):
        lengths = pc.list_value_length(array)
        shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
        if shortest != longest:
            raise ValueError(f"ParquetDataset: column {name!r} has rows of {shortest} to {longest} values; a list "
                             "column becomes one 2-d tensor, so its rows need one length (pack or pad them)")
        values = array.flatten().to_numpy(zero_copy_only=False)
        return torch.from_numpy(values.reshape(len(array), -1).copy())
    return torch.from_numpy(array.to_numpy(zero_copy_only=False).copy())
