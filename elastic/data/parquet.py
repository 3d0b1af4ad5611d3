"""A streaming map-style dataset over Parquet files, through `pyarrow.dataset` and any `pyarrow.fs`.

Only the files' footers are read up front. The samples are numbered in file order, and each
row group is one block of the epoch order (`elastic.data.order.EpochOrder`): a step reads only the
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

# Rows kept decoded when no loader sized the cache (a dataset read directly, e.g. for an evaluation).
DEFAULT_CACHE_ROWS = 2 * 262_144


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
        self._schema, self._format, self._filesystem = dataset.schema, dataset.format, dataset.filesystem
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
        # None: the loader sizes it from DataConfig.shuffle_window; read without one, the default.
        self.cache_rows = cache_rows
        self._cache: OrderedDict[int, dict[str, numpy.ndarray]] = OrderedDict()
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
        runs = _runs(blocks[order])
        columns_of = self._blocks([block for block, _, _ in runs])
        # numpy's fancy indexing, not torch's: ~8x less overhead on batch-sized copies.
        out: dict[str, numpy.ndarray] = {}
        for block, start, stop in runs:
            where = order[start:stop]  # the positions in the request of this block's rows
            rows = ids[where] - self._first_ids[block]
            for name, column in columns_of[block].items():
                if name not in out:
                    out[name] = numpy.empty((len(ids), *column.shape[1:]), dtype=column.dtype)
                out[name][where] = column[rows]
        return {name: torch.from_numpy(array) for name, array in out.items()}

    def _blocks(self, blocks: list[int]) -> dict[int, dict[str, numpy.ndarray]]:
        """Row groups `blocks`, each as one array per column: cached, or read together (pyarrow
        reads them in parallel), or taken from another thread that is reading them."""
        found: dict[int, dict[str, numpy.ndarray]] = {}
        while len(found) < len(blocks):
            mine, theirs = [], []
            with self._lock:
                for block in blocks:
                    if block in found:
                        continue
                    if block in self._cache:
                        self._cache.move_to_end(block)
                        found[block] = self._cache[block]
                    elif block in self._reading:
                        theirs.append(self._reading[block])
                    else:
                        self._reading[block] = threading.Event()
                        mine.append(block)
            if mine:
                found.update(self._read(mine))
            for reading in theirs:
                reading.wait()  # a row group is never read twice at once; take the other thread's copy
        return found

    def _read(self, blocks: list[int]) -> dict[int, dict[str, numpy.ndarray]]:
        try:
            # Outside the lock: pyarrow releases the GIL, so prefetch threads read in parallel.
            part = pads.FileSystemDataset([self._row_groups[b] for b in blocks], self._schema,
                                          self._format, self._filesystem)
            table = part.to_table(columns=self.columns)
            read, offset = {}, 0
            for block in blocks:
                rows = table.slice(offset, self.block_sizes[block])
                read[block] = {name: _column_array(name, rows.column(name)) for name in self.columns}
                offset += self.block_sizes[block]
            with self._lock:
                self.row_groups_read += len(blocks)
                self._cache.update(read)
                held = sum(self.block_sizes[b] for b in self._cache)
                limit = self.cache_rows if self.cache_rows is not None else DEFAULT_CACHE_ROWS
                while held > limit and len(self._cache) > 1:
                    held -= self.block_sizes[self._cache.popitem(last=False)[0]]
            return read
        finally:
            with self._lock:
                events = [self._reading.pop(block) for block in blocks]
            for event in events:
                event.set()

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


def _column_array(name: str, column: pa.ChunkedArray) -> numpy.ndarray:
    array = column.combine_chunks()
    nulls = array.null_count + (array.flatten().null_count if _is_list(array.type) else 0)
    if nulls:
        raise ValueError(f"ParquetDataset: column {name!r} has {nulls} nulls in a row group; "
                         "fill them in the files, or pass columns=[...] without it")
    if _is_list(array.type):
        lengths = pc.list_value_length(array)
        shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
        if shortest != longest:
            raise ValueError(f"ParquetDataset: column {name!r} has rows of {shortest} to {longest} values; a list "
                             "column becomes one 2-d tensor, so its rows need one length (pack or pad them)")
        return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), -1)
    return array.to_numpy(zero_copy_only=False)
