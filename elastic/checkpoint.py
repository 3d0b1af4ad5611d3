"""Durable checkpoints: `checkpoints/step_<N>/` with shard files and a manifest written last.

At a step boundary every rank copies the state to CPU (`take_snapshot`, the only time
training is blocked) and a background thread writes its shard: rank r of W writes the r-th
slice of each flat dtype buffer, so the write is spread over all ranks. Rank 0's shard also
holds the structure, and rank 0 writes the user's own files. When the controller has heard
of every shard, it writes `manifest.json`, listing each file's size and sha256, the step,
world size, data cursor and format version. A folder without a valid manifest whose files
all match is not a checkpoint, for any reader. `verify` hashes every file once; the
`Checkpoint` it returns remembers that, so loading it checks only sizes (a checkpoint made
any other way is hashed as it loads). Loading uses `torch.load(weights_only=True)`:
storage is shared, and a checkpoint must never be able to run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from elastic.data import share_bounds
from elastic.errors import ElasticError
from elastic.flat_state import flatten, unflatten
from elastic.storage import RunStorage

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
USER_FILES = "user"


class CheckpointError(ElasticError):
    """A checkpoint is incomplete, damaged, or does not fit the run; the message says which."""


def step_dir(step: int) -> str:
    return f"{CHECKPOINTS}/step_{step}"


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


@dataclass(frozen=True)
class Snapshot:
    """The CPU copy of the state at a step boundary."""

    step: int
    progress: dict[str, Any]
    structure: Any
    buffers: dict[str, torch.Tensor]


def take_snapshot(states: dict[str, Any], progress: dict[str, Any]) -> Snapshot:
    structure, buffers = flatten({"progress": progress, "state": states}, torch.device("cpu"))
    return Snapshot(progress["step"], progress, structure, buffers)


def shard_bytes(snapshot: Snapshot, rank: int, world_size: int) -> bytes:
    """Rank's shard: its slice of every buffer (cloned, so torch.save stores only the slice)."""
    chunks = {}
    for dtype, buffer in snapshot.buffers.items():
        start, stop = share_bounds(buffer.numel(), world_size, rank)
        chunks[dtype] = buffer[start:stop].clone()
    payload = {"format_version": FORMAT_VERSION, "rank": rank, "world_size": world_size, "chunks": chunks,
               "structure": snapshot.structure if rank == 0 else None}
    out = io.BytesIO()
    torch.save(payload, out)
    return out.getvalue()


def write_manifest(storage: RunStorage, snapshot_progress: dict[str, Any], world_size: int,
                   files: list[dict[str, Any]], metadata: dict[str, Any]) -> dict[str, Any]:
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": snapshot_progress["step"],
        "world_size": world_size,
        "cursor": snapshot_progress["cursor"],
        "files": sorted(files, key=lambda f: f["name"]),
        "metadata": metadata,
        "created": time.time(),
    }
    storage.write_text_atomic(f"{step_dir(manifest['step'])}/{MANIFEST}", json.dumps(manifest, indent=1))
    return manifest


class Checkpoint:
    """A complete checkpoint. Load it anywhere, with or without Ray:

        state = Checkpoint.from_path("/tmp/runs/lm/checkpoints/step_100").load_state()
        model.load_state_dict(state["model"])
    """

    def __init__(self, storage: RunStorage, manifest: dict[str, Any], verified: bool = False) -> None:
        self.storage = storage
        self.manifest = manifest
        # True when `verify` hashed every file: loading then checks sizes, not sha256 again.
        self.verified = verified

    @classmethod
    def from_path(cls, path: str, filesystem=None) -> "Checkpoint":
        """Open and verify the checkpoint folder at `path` (local path or URI)."""
        parent, _, name = path.rstrip("/").rpartition("/")
        return verify(RunStorage(parent or ".", name, filesystem))

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def cursor(self) -> dict[str, int]:
        return self.manifest["cursor"]

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest["metadata"]

    @property
    def path(self) -> str:
        return self.storage.uri

    def read_file(self, name: str) -> bytes:
        """A file the train loop stored with `ctx.add_checkpoint_file(name, data)`."""
        return self._read(self._entry(f"{USER_FILES}/{name}"))

    def load_state(self) -> dict[str, Any]:
        """{"model": ..., "optimizer": ..., <other registered state>..., "progress": {...}}."""
        world_size = self.world_size
        shards = []
        for rank in range(world_size):
            data = self._read(self._entry(shard_name(rank, world_size)))
            shards.append(torch.load(io.BytesIO(data), weights_only=True))
        buffers = {dtype: torch.cat([s["chunks"][dtype] for s in shards]) for dtype in shards[0]["chunks"]}
        payload = unflatten(shards[0]["structure"], buffers)
        return {**payload["state"], "progress": payload["progress"]}

    def _read(self, entry: dict[str, Any]) -> bytes:
        data = self.storage.read_bytes(entry["name"])
        _check_size(entry, len(data))
        if not self.verified:
            _check_sha256(entry, data)
        return data

    def _entry(self, name: str) -> dict[str, Any]:
        for entry in self.manifest["files"]:
            if entry["name"] == name:
                return entry
        raise CheckpointError(f"checkpoint {self.path} has no file {name!r}")

    def __repr__(self) -> str:
        return f"Checkpoint(step={self.step}, path={self.path!r})"


def _check_size(entry: dict[str, Any], size: int) -> None:
    if size != entry["size"]:
        raise CheckpointError(f"file {entry['name']} is truncated: {size} bytes, manifest says {entry['size']}")


def _check_sha256(entry: dict[str, Any], data: bytes) -> None:
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"file {entry['name']} has a wrong checksum (sha256 differs from the manifest)")


def verify(storage: RunStorage) -> Checkpoint:
    """The checkpoint in `storage`'s folder, after checking its manifest and every file's sha256."""
    try:
        manifest = json.loads(storage.read_text(MANIFEST))
    except FileNotFoundError:
        raise CheckpointError(f"{storage.uri} has no {MANIFEST}: the checkpoint was never completed") from None
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{storage.uri}/{MANIFEST} cannot be read: {exc}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{storage.uri} has format_version {manifest.get('format_version')!r}, this elastic reads "
            f"{FORMAT_VERSION}; load it with the elastic version that wrote it"
        )
    for entry in manifest["files"]:
        size = storage.size(entry["name"])
        if size is None:
            raise CheckpointError(f"file {entry['name']} listed in the manifest is missing")
        _check_size(entry, size)
        _check_sha256(entry, storage.read_bytes(entry["name"]))
    return Checkpoint(storage, manifest, verified=True)


def checkpoint_steps(run: RunStorage) -> list[int]:
    """Steps of every checkpoint folder, complete or not, oldest first."""
    steps = []
    for name in run.list_dirs(CHECKPOINTS):
        prefix, _, number = name.partition("_")
        if prefix == "step" and number.isdigit():
            steps.append(int(number))
    return sorted(steps)


def checkpoint_storage(run: RunStorage, step: int) -> RunStorage:
    return RunStorage(run.root, step_dir(step), run.fs)


def latest_complete(run: RunStorage, on_skip: Callable[[int, str], None]) -> Checkpoint | None:
    """The newest checkpoint that verifies; each newer one that does not is reported to on_skip."""
    for step in reversed(checkpoint_steps(run)):
        try:
            return verify(checkpoint_storage(run, step))
        except CheckpointError as exc:
            on_skip(step, str(exc))
    return None


def steps_to_delete(steps: list[int], complete: list[int], keep_last: int) -> list[int]:
    """Old checkpoints to delete once the newest complete one exists.

    The `keep_last` newest complete ones stay; incomplete folders older than the newest
    complete one can never complete and go too. Nothing newer than it is touched: it may be
    a checkpoint still being written.
    """
    if not complete:
        return []
    kept = set(sorted(complete)[-keep_last:])
    newest = max(complete)
    return [s for s in steps if s < newest and s not in kept]


class CheckpointWriter:
    """Writes this rank's shards in a background thread, one checkpoint at a time."""

    def __init__(self, run: RunStorage, on_written: Callable[[dict[str, Any]], None]) -> None:
        self.run = run
        self.on_written = on_written
        self._thread: threading.Thread | None = None

    def submit(self, snapshot: Snapshot, rank: int, world_size: int, stall_s: float,
               user_files: dict[str, bytes], metadata: dict[str, Any], crash_midway: bool = False) -> None:
        self.wait()
        self._thread = threading.Thread(
            target=self._write,
            args=(snapshot, rank, world_size, stall_s, dict(user_files), dict(metadata), crash_midway),
            daemon=True, name="elastic-checkpoint",
        )
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, snapshot: Snapshot, rank: int, world_size: int, stall_s: float,
               user_files: dict[str, bytes], metadata: dict[str, Any], crash_midway: bool) -> None:
        started = time.perf_counter()
        folder = checkpoint_storage(self.run, snapshot.step)
        report: dict[str, Any] = {"step": snapshot.step, "rank": rank, "world_size": world_size,
                                  "progress": snapshot.progress, "stall_s": stall_s, "files": []}
        try:
            self.run.fs.create_dir(folder.root, recursive=True)
            files = {shard_name(rank, world_size): shard_bytes(snapshot, rank, world_size)}
            if rank == 0:
                files.update({f"{USER_FILES}/{name}": data for name, data in user_files.items()})
                report["metadata"] = metadata
            for name, data in files.items():
                if crash_midway:
                    _crash_while_writing(folder, name, data)
                folder.write_bytes(name, data)
                report["files"].append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        except Exception as exc:  # any storage error: the checkpoint stays incomplete, training goes on
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["upload_s"] = time.perf_counter() - started
        self.on_written(report)


def _crash_while_writing(folder: RunStorage, name: str, data: bytes) -> None:
    """Injected fault: half the shard reaches storage, then the process dies like a crash."""
    with folder.fs.open_output_stream(folder.path(name)) as out:
        out.write(data[: len(data) // 2])
        out.flush()
        os._exit(1)
