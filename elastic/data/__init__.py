"""The data path, exactly once at any world size: the global cursor, the epoch order and the
batch split (`order`, pure arithmetic), the map-style loader that reads a rank's micro-batches
ahead of the step (`loader`), the stream of an iterable dataset (`stream`), and the Parquet
dataset (`parquet`).

May import only the vocabulary below it: `elastic.errors`, `elastic.config`, `elastic.faults`.
`elastic.ParquetDataset` is imported lazily, so nothing is re-exported here: a worker whose
run reads no Parquet never imports pyarrow.dataset.
"""
