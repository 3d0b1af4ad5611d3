"""Checkpoints and the run folder they live in: the folder on any `pyarrow.fs` filesystem
(`storage`), writing, listing and reading checkpoints (`checkpoint`), completing one from the
shard each rank reports (`shards`), and the directory a train loop hands to
`elastic.report(checkpoint=...)` (`reported`).

May import `elastic.comm`, `elastic.data` and `elastic.controller` below it, and the vocabulary
(`elastic.errors`, `elastic.config`, `elastic.faults`). `Checkpoint` is re-exported here, where
users load one: `elastic.checkpoint.Checkpoint.from_path(path)`.
"""

from elastic.checkpoint.checkpoint import Checkpoint

__all__ = ["Checkpoint"]
