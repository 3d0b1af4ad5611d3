"""Ray Train's `report(metrics, checkpoint=...)`, on elastic's own checkpoints.

In Ray Train a worker reports a directory, its files are persisted to the run's storage and
become the latest checkpoint, and after a restart `get_checkpoint()` hands it back. Here rank
0 reports a local directory (a path, or any object with Ray Train's `as_directory()`, such as
`ray.train.Checkpoint.from_directory(d)` or a checkpoint `get_checkpoint()` returned). Its
files are read at once, so a temporary directory may go away when `report` returns, and are
stored under `reported/` in the next checkpoint the run writes: the one at this step when the
checkpoint schedule writes one here, and every later one until rank 0 reports another
directory. `elastic.get_checkpoint()` returns the run's latest complete checkpoint when it
holds a reported directory, and `Checkpoint.as_directory()` / `to_directory()` give its files
back as a local directory, after a heal, a restart or a resume alike.

Only rank 0's directory is stored: every rank holds the same synced state after a step, and
elastic checkpoints sharded state (ZeRO's) itself, so one directory per checkpoint is enough
and two ranks can never disagree about a file.
"""

from __future__ import annotations

import os
from typing import Any

from elastic.config import CheckpointConfig
from elastic.errors import ReportedCheckpointError


def files_to_store(checkpoint: Any, rank: int, checkpoint_config: CheckpointConfig) -> dict[str, bytes]:
    """The files of the directory `checkpoint` names, by relative path with '/' separators;
    raises ReportedCheckpointError when it cannot be stored."""
    if rank < 0:
        raise ReportedCheckpointError(
            "elastic.report(checkpoint=...) is called before ctx.steps() formed the first generation; "
            "report a checkpoint after a step, when it holds that step's state")
    if not checkpoint_config.enabled:
        raise ReportedCheckpointError(
            "elastic.report(checkpoint=...) stores the directory in the run's next checkpoint, but "
            "RunConfig(checkpoint_config=CheckpointConfig()) schedules none; set CheckpointConfig(every_steps=N) "
            "(a checkpoint every N steps and at the end) or every_s=T")
    if rank != 0:
        raise ReportedCheckpointError(
            f"elastic.report(checkpoint=...) is called on rank {rank}; elastic stores the directory rank 0 reports "
            "(every rank holds the same synced state after a step), so pass a checkpoint on rank 0 only: "
            "checkpoint=... if ctx.rank == 0 else None")
    if hasattr(checkpoint, "as_directory"):
        with checkpoint.as_directory() as directory:
            return read_directory(directory, checkpoint)
    if isinstance(checkpoint, (str, os.PathLike)):
        return read_directory(os.fspath(checkpoint), checkpoint)
    raise ReportedCheckpointError(
        f"elastic.report(checkpoint={checkpoint!r}): a {type(checkpoint).__name__} is not a checkpoint; pass the "
        "path of a local directory, or an object with as_directory() such as ray.train.Checkpoint.from_directory(path)")


def read_directory(directory: str, given: Any) -> dict[str, bytes]:
    """Every file below `directory`, read now, by path relative to it."""
    if not os.path.isdir(directory):
        raise ReportedCheckpointError(
            f"elastic.report(checkpoint={given!r}): {directory!r} is not a directory; pass the path of a local "
            "directory holding the checkpoint's files")
    files = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as stream:
                files[os.path.relpath(path, directory).replace(os.sep, "/")] = stream.read()
    return files


def write_directory(files: dict[str, bytes], directory: str) -> str:
    """Write `files` (relative path -> bytes) below `directory`; returns `directory`."""
    for name, data in files.items():
        path = os.path.join(directory, *name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as stream:
            stream.write(data)
    return directory
