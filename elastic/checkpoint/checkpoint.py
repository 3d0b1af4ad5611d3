"""Durable checkpoints: `checkpoints/step_<N>/` with shard files and a manifest written last.

At a step boundary every rank copies to CPU the part of the state it writes (`take_snapshot`,
the only time training is blocked: each tensor's part is copied once, into a buffer allocated
for the share) and a background thread writes its shard: rank r of W writes the r-th slice of
each flat dtype buffer, so the copy and the write are spread over all ranks. Rank 0's shard
also holds the structure, and rank 0 writes the user's own files and the directory it last
reported with `elastic.report(checkpoint=...)` (under `reported/`, see `elastic.checkpoint.reported`).
A shard is a safetensors file (`elastic.checkpoint.tensor_file`) written straight from the
snapshot's buffers, with no pickling and no copy; a helper thread takes its sha256 from the same
memory, part by part, while the part is written, and on a local disk every file is fsynced before it is
reported, and the manifest before older checkpoints are deleted. When the controller has heard
of every shard, it writes `manifest.json`, listing each file's size and sha256, the step, world
size, data cursor and format version. A folder without a valid manifest whose files all match is not a checkpoint,
for any reader. `verify` hashes every file once; the `Checkpoint` it returns remembers that,
so loading it checks only sizes (a checkpoint made any other way is hashed as it loads).
Loading runs no code: safetensors for the tensors, `torch.load(weights_only=True)` for the
small structure, and for the `torch.save` shards of format versions 1 and 2, which still load.

In a run of replicas each place of a replica holds state of its own, so each is a part of its
own, `<part>/`, whose shards the replicas write as ranks write a plain run's: replica r of R
writes the r-th slice of its part's state. The checkpoint stores and lists parts by name without
reading the names (the layer that lays replicas out, `elastic.parallel.parts`, gives them). A
part resumes at any number of replicas, and `model_state_dict()` joins the parts' models into the
whole model's state dict (`join_parts`): parts that hold other tensors side by side, and parts
that hold slices of the same tensors along the dimension each was cut.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator

import pyarrow.fs as pafs
import torch

from elastic.checkpoint import tensor_file
from elastic.checkpoint.host_buffers import HostBuffers
from elastic.checkpoint.reported import write_directory
from elastic.checkpoint.storage import RunStorage
from elastic.comm.flat_state import describe, gather, numel, unflatten
from elastic.data.order import share_bounds
from elastic.errors import ElasticError

_log = logging.getLogger(__name__)

# 3: shards are safetensors files (`tensor_file`); 1 and 2 wrote them with torch.save (".pt").
# 2: each file lies under the folder of the generation that wrote it (its manifest entry's
# "path"), so a writer cut off from a generation that moved on never overwrites a listed file.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1 kept every file at its name
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
USER_FILES = "user"
REPORTED = "reported"  # the directory rank 0 reported with elastic.report(checkpoint=...)
OPTIMIZER_SHARDS = "optimizer-shards"
WHOLE = -1  # in a sliced part's model, the cut dimension of a tensor every part holds whole
LEGACY_SUFFIX = ".pt"  # the torch.save shards of format versions 1 and 2
# A file is hashed and written in parts of this size: small enough that the hash and the write
# read a part while it is still in the CPU cache (hashing a whole shard while another thread
# writes it was slower: each read it from memory on its own).
HASH_PART_BYTES = 8 << 20


class CheckpointError(ElasticError):
    """A checkpoint is incomplete, damaged, or does not fit the run; the message says which."""


def step_dir(step: int) -> str:
    return f"{CHECKPOINTS}/step_{step}"


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}{tensor_file.SUFFIX}"


def join_parts(models: list[dict[str, Any]]) -> dict[str, Any]:
    """One state dict from the models of parts, in part order. A part's model holds whole tensors by
    name, or slices: its "tensors" and the dimension each is cut along ("dims", WHOLE for one every
    part holds whole). A sliced tensor is its parts' slices joined along that dimension, in part order."""
    joined: dict[str, Any] = {}
    slices: dict[str, tuple[int, list[torch.Tensor]]] = {}
    for model in models:
        if "tensors" in model and "dims" in model:
            for name, dim in model["dims"].items():
                slices.setdefault(name, (dim, []))[1].append(model["tensors"][name])
                joined.setdefault(name, None)  # holds its place in the order until joined
        else:
            joined.update(model)
    for name, (dim, pieces) in slices.items():
        joined[name] = pieces[0] if dim == WHOLE else torch.cat(pieces, dim)
    return joined


def _in_order(name: str) -> list[Any]:
    """`name` as its text and its numbers, so that "part-2" sorts before "part-10"."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class Part:
    """The part of a checkpoint a rank writes a slice of: its place's in every replica, sliced over the replicas."""

    name: str
    index: int  # the writer's replica
    count: int  # the replicas


def optimizer_shard_name(rank: int, world_size: int) -> str:
    """The file of rank's part of a sharded (ZeRO) optimizer state."""
    return f"{OPTIMIZER_SHARDS}/{rank:05d}-of-{world_size:05d}{tensor_file.SUFFIX}"


@dataclass(frozen=True)
class Snapshot:
    """The CPU copy, at a step boundary, of the part of the state that one rank writes."""

    step: int
    progress: dict[str, Any]
    structure: Any
    buffers: dict[str, torch.Tensor]
    """Each dtype's share for `rank` of `world_size`: all of the flat buffer when world_size is 1."""
    rank: int = 0
    world_size: int = 1
    pool: HostBuffers | None = None  # where its buffers go back once it is written or skipped
    copied: Any = None  # a CUDA event recorded after the copies from the GPU, which the host did not wait for
    optimizer_shard: dict[str, Any] | None = None  # a copy of this rank's part of a ZeRO optimizer's state

    def wait_copied(self) -> None:
        """Return once the buffers hold the state: at once for state on CPUs, else when the GPU's copies landed."""
        if self.copied is not None:
            self.copied.synchronize()

    def release(self) -> None:
        """Give the buffers back for the next snapshot: this one is written, or will never be."""
        if self.pool is not None:
            self.wait_copied()  # a copy still landing in them would overwrite the next snapshot's
            self.pool.give_back(list(self.buffers.values()))


def take_snapshot(states: dict[str, Any], progress: dict[str, Any], rank: int = 0, world_size: int = 1,
                  pool: HostBuffers | None = None, optimizer_shard: dict[str, Any] | None = None) -> Snapshot:
    """Copy to CPU the share of the state that `rank` of `world_size` writes (by default, all of it),
    and `optimizer_shard`, this rank's part of a ZeRO optimizer's state (the live tensors).

    Training waits for this copy, so it is a single one: each tensor's part goes straight into
    a buffer for the share, from `pool` where one is given (reused, and pinned for GPU state:
    `elastic.checkpoint.host_buffers`), else allocated. Every rank holds the same state, so a
    rank copies only the slice it writes.

    From a GPU into pinned buffers the copies are queued on the current stream without the host
    waiting (a blocking copy to the host would synchronize and lose the host's lead over the
    device), and an event is recorded after them: whoever reads the buffers waits for it
    (`Snapshot.wait_copied`: the writer's thread). The next step's kernels queue behind the copies
    on the same stream, so nothing writes the state (the optimizer's step, BatchNorm's statistics in
    a forward, a heal's broadcast) before it is copied. The optimizer shard's GPU tensors go the
    same way into pinned memory from torch's caching host allocator, before the event.
    """
    structure, tensors = describe({"progress": progress, "state": states})
    buffers = {}
    from_gpu = False
    for dtype, parts in tensors.items():
        start, stop = share_bounds(numel(parts), world_size, rank)
        pinned = any(part.is_cuda for part in parts)
        buffer = pool.take(parts[0].dtype, stop - start, pinned) if pool is not None else None
        queued = pinned and buffer is not None
        buffers[dtype] = gather(parts, start, stop, torch.device("cpu"), buffer, non_blocking=queued)
        from_gpu |= queued
    shard = None
    if optimizer_shard is not None:
        shard = _host_copy(optimizer_shard)
        from_gpu |= any(t.is_cuda for parts in describe(optimizer_shard)[1].values() for t in parts)
    copied = None
    if from_gpu:
        copied = torch.cuda.Event()
        copied.record()
    return Snapshot(progress["step"], progress, structure, buffers, rank, world_size, pool, copied, shard)


def _host_copy(value: Any) -> Any:
    """`value` with every tensor copied to the host: from a GPU into pinned memory, queued."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            return torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value.detach(), non_blocking=True)
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _host_copy(item) for key, item in value.items()}
    return value


def shard_chunks(snapshot: Snapshot, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank's slice of every dtype buffer."""
    if (snapshot.rank, snapshot.world_size) == (rank, world_size):
        return dict(snapshot.buffers)
    if snapshot.world_size != 1:
        raise ValueError(f"the snapshot holds the share of rank {snapshot.rank} of {snapshot.world_size}, "
                         f"not of rank {rank} of {world_size}; take it with take_snapshot(..., {rank}, {world_size})")
    chunks = {}
    for dtype, buffer in snapshot.buffers.items():
        start, stop = share_bounds(buffer.numel(), world_size, rank)
        chunks[dtype] = buffer[start:stop]
    return chunks


def write_manifest(storage: RunStorage, snapshot_progress: dict[str, Any], world_size: int,
                   files: list[dict[str, Any]], metadata: dict[str, Any], attempt: str = "") -> dict[str, Any]:
    """Complete the checkpoint of `snapshot_progress`'s step; `attempt`: the fit() that wrote it
    (`latest_complete(attempt=)`)."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": snapshot_progress["step"],
        "world_size": world_size,
        "cursor": snapshot_progress["cursor"],
        "files": sorted(files, key=lambda f: f["name"]),
        "metadata": metadata,
        "created": time.time(),
        "attempt": attempt,
    }
    folder = step_dir(manifest["step"])
    storage.write_text_atomic(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1))
    # Durable before retention deletes older checkpoints. A manifest torn by a crash before
    # these fsyncs does not parse or match its files, so it is never taken for a checkpoint.
    _fsync(storage.fs, storage.path(f"{folder}/{MANIFEST}"))
    _fsync(storage.fs, storage.path(folder))
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

    def reported_files(self) -> list[str]:
        """The files of the directory rank 0 reported with `elastic.report(checkpoint=...)`, by
        relative path; empty when it reported none."""
        prefix = f"{REPORTED}/"
        return sorted(e["name"][len(prefix):] for e in self.manifest["files"] if e["name"].startswith(prefix))

    def read_reported(self) -> dict[str, bytes]:
        """The reported directory's files, by relative path."""
        return {name: self._read(self._entry(f"{REPORTED}/{name}")) for name in self.reported_files()}

    def to_directory(self, path: str | None = None) -> str:
        """Write the reported directory's files below `path` (by default a new temporary
        directory) and return it, as Ray Train's `Checkpoint.to_directory` does."""
        return write_directory(self.read_reported(), path or tempfile.mkdtemp(prefix="elastic-checkpoint-"))

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """The reported directory's files in a local temporary directory, removed afterwards, as
        Ray Train's `Checkpoint.as_directory` gives them."""
        with tempfile.TemporaryDirectory(prefix="elastic-checkpoint-") as directory:
            yield self.to_directory(directory)

    def load_optimizer_shards(self, wanted: Callable[[int, int], bool] | None = None) -> list[dict[str, Any]]:
        """The parts of a sharded optimizer state, as `ShardedOptimizer.load_sharded` takes them:
        every rank's, or those of the (rank, world_size) that `wanted` accepts (at least one)."""
        names = sorted(e["name"] for e in self.manifest["files"] if e["name"].startswith(f"{OPTIMIZER_SHARDS}/"))
        if not names:
            raise CheckpointError(f"checkpoint {self.path} holds no sharded optimizer state: it was written "
                                  "without Strategy(zero=1, 2 or 3); resume it with the same strategy")
        if wanted is not None:
            writers = [tuple(int(n) for n in name.split("/")[-1].split(".")[0].split("-of-")) for name in names]
            names = [name for name, (rank, size) in zip(names, writers) if wanted(rank, size)] or names[:1]
        pieces = []
        for name in names:
            data = self._read(self._entry(name))
            if name.endswith(LEGACY_SUFFIX):
                pieces.append(torch.load(io.BytesIO(data), weights_only=True))
            else:
                buffers, structure = tensor_file.decode(data)
                pieces.append(unflatten(structure, buffers))
        return pieces

    @property
    def parts(self) -> list[str]:
        """A run of replicas' parts, the folders holding shards beside the checkpoint's own, in order of their
        names' numbers; [] for a plain run."""
        own = (USER_FILES, REPORTED, OPTIMIZER_SHARDS)
        folders = {folder for folder, _, file in (e["name"].partition("/") for e in self.manifest["files"])
                   if file.startswith("shard-") and "/" not in file and folder not in own}
        return sorted(folders, key=_in_order)

    def load_state(self, part: str = "") -> dict[str, Any]:
        """{"model": ..., "optimizer": ..., <other registered state>..., "progress": {...}}: of the
        whole run, or of one `part` (of a run of replicas)."""
        if part not in (self.parts or [""]):
            written = f"with the parts {self.parts}" if self.parts else "without parts (a run without replicas)"
            raise CheckpointError(f"checkpoint {self.path} has no part {part!r}: it was written {written}; resume it "
                                  "with the replica shape of the run that wrote it, or load one of its parts with "
                                  "load_state(part)")
        prefix = f"{part}/shard-" if part else "shard-"
        names = sorted(e["name"] for e in self.manifest["files"] if e["name"].startswith(prefix))
        shards = [_read_shard(name, self._read(self._entry(name))) for name in names]
        buffers = {dtype: torch.cat([chunks[dtype] for chunks, _ in shards]) for dtype in shards[0][0]}
        payload = unflatten(shards[0][1], buffers)
        return {**payload["state"], "progress": payload["progress"]}

    def model_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict: its parts' models joined (`join_parts`), under the given model's names."""
        return join_parts([self.load_state(part)["model"] for part in self.parts or [""]])

    def _read(self, entry: dict[str, Any]) -> bytes:
        try:
            data = self.storage.read_bytes(file_path(entry))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.path} lost its file {file_path(entry)} (its manifest lists it): "
                                  "the folder was changed after the checkpoint completed") from None
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


def _read_shard(name: str, data: bytes) -> tuple[dict[str, torch.Tensor], Any]:
    """(the shard's chunk of each dtype buffer, the structure or None) of a shard file."""
    if name.endswith(LEGACY_SUFFIX):
        shard = torch.load(io.BytesIO(data), weights_only=True)
        return shard["chunks"], shard["structure"]
    return tensor_file.decode(data)


def _check_size(entry: dict[str, Any], size: int) -> None:
    if size != entry["size"]:
        raise CheckpointError(f"file {entry['name']} is truncated: {size} bytes, manifest says {entry['size']}")


def _check_sha256(entry: dict[str, Any], data: bytes) -> None:
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"file {entry['name']} has a wrong checksum (sha256 differs from the manifest)")


def _read_manifest(folder: RunStorage) -> Any:
    """The JSON in `folder`'s manifest, unchecked; FileNotFoundError where there is none, and a
    CheckpointError where it cannot be read or parsed."""
    try:
        return json.loads(folder.read_text(MANIFEST))
    except FileNotFoundError:
        raise
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{folder.uri}/{MANIFEST} cannot be read: {exc}") from None


def verify(storage: RunStorage) -> Checkpoint:
    """The checkpoint in `storage`'s folder, after checking its manifest and every file's sha256."""
    try:
        manifest = _read_manifest(storage)
    except FileNotFoundError:
        raise CheckpointError(f"{storage.uri} has no {MANIFEST}: the checkpoint was never completed") from None
    not_a_manifest = CheckpointError(f"{storage.uri}/{MANIFEST} is not a manifest elastic wrote (it lacks the list "
                                     "of files with their name, size and sha256): the folder is not a checkpoint")
    if not isinstance(manifest, dict):
        raise not_a_manifest
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{storage.uri} has format_version {manifest.get('format_version')!r}, this elastic reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}; load it with the elastic version that wrote it"
        )
    if not (isinstance(manifest.get("files"), list)
            and all(isinstance(e, dict) and {"name", "size", "sha256"} <= e.keys() for e in manifest["files"])):
        raise not_a_manifest
    for entry in manifest["files"]:
        size = storage.size(file_path(entry))
        if size is None:
            raise CheckpointError(f"file {file_path(entry)} listed in the manifest is missing")
        _check_size(entry, size)
        _check_sha256(entry, storage.read_bytes(file_path(entry)))
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


def latest_complete(run: RunStorage, on_skip: Callable[[int, str], None], attempt: str | None = None
                    ) -> Checkpoint | None:
    """The newest checkpoint that verifies; each newer one that does not is reported to on_skip.
    With `attempt`, the newest that fit() attempt wrote (older manifests name none)."""
    for step in reversed(checkpoint_steps(run)):
        folder = checkpoint_storage(run, step)
        try:
            if attempt is not None and _written_by(folder) != attempt:
                continue
            return verify(folder)
        except CheckpointError as exc:
            on_skip(step, str(exc))
    return None


def check_resume_keeps_history(run: RunStorage, resume_from: Checkpoint) -> None:
    """Refuse a `resume_from` whose run would overwrite or delete complete checkpoints of the run
    folder's own history: those past its step, where it is one of this run's (the run writes its
    own steps over them), or every one, where it is another run's (retention deletes them)."""
    def verifies(step: int) -> bool:
        try:
            verify(checkpoint_storage(run, step))
        except CheckpointError:
            return False  # incomplete or damaged: a resume by name skips it, and nothing of it is lost
        return True

    # The same checkpoint, whatever path named it (a symlink, another spelling of the URI).
    try:
        ours = _read_manifest(checkpoint_storage(run, resume_from.step)) == resume_from.manifest
    except (FileNotFoundError, CheckpointError):
        ours = False
    kept = [s for s in checkpoint_steps(run) if (s > resume_from.step or not ours) and verifies(s)]
    if not kept:
        return
    if ours:
        raise ElasticError(
            f"resume_from is step {resume_from.step} of this run, whose folder {run.uri} holds later checkpoints "
            f"(steps {', '.join(map(str, kept))}): the run would overwrite them with another history. To go on "
            f"from step {resume_from.step}, give it a new RunConfig(name=...) (it branches into its own folder), "
            "or delete the later checkpoints first; to go on from the latest, leave resume_from out")
    raise ElasticError(
        f"the run folder {run.uri} holds checkpoints of its own (steps {', '.join(map(str, kept))}), and "
        f"resume_from names another run's ({resume_from.path}): as this run went on, retention would delete "
        "them. Give this run a new RunConfig(name=...), or leave resume_from out to resume the run's own latest")


def _written_by(folder: RunStorage) -> str | None:
    """The attempt its manifest names, read without checking its files; None where there is none."""
    try:
        manifest = _read_manifest(folder)
    except FileNotFoundError:
        return None
    return manifest.get("attempt") if isinstance(manifest, dict) else None


def steps_to_delete(steps: list[int], complete: list[int], keep_last: int, latest: int,
                    pinned: Collection[int] = ()) -> list[int]:
    """Old checkpoints to delete once the controller took step `latest` for the run's latest.

    The `keep_last` newest complete ones up to `latest` stay, and any `pinned` (one a restart in
    flight restores); incomplete folders older than `latest` can never complete and go too.
    Nothing newer than `latest` is touched: it may be a checkpoint still being written, or one
    this run never took (a damaged one a resume skipped, the steps past an older `resume_from`),
    whose manifest says nothing of this run's history.
    """
    kept = set(sorted(s for s in complete if s <= latest)[-keep_last:]) | {latest} | set(pinned)
    return [s for s in steps if s < latest and s not in kept]


class CheckpointWriter:
    """Writes this rank's shards on a thread of its own, one checkpoint at a time, and never makes
    the caller wait for the store.

    A store that stalls (an endpoint throttling, a NAS that hangs) holds only this thread. A
    snapshot submitted meanwhile waits in one slot, and a newer one takes its place: the older
    is reported as skipped (`on_written` with "skipped"), so at most two snapshots (the one
    uploading and the one waiting) are held whatever the store does, and the next upload is
    always of the newest state.
    """

    def __init__(self, run: RunStorage, on_written: Callable[[dict[str, Any]], None], attempt: str = "") -> None:
        self.run = run
        self.on_written = on_written
        self.attempt = attempt  # the fit() it writes for: in each file's path (`generation_path`)
        self._changed = threading.Condition()
        self._waiting: _Upload | None = None
        self._skipped: list[dict[str, Any]] = []  # reports of replaced snapshots, sent by the thread
        self._uploading = False
        self._thread: threading.Thread | None = None

    def submit(self, snapshot: Snapshot, rank: int, world_size: int, stall_s: float,
               user_files: dict[str, bytes], metadata: dict[str, Any], crash_midway: Callable[[], None] | None = None,
               reported_files: dict[str, bytes] | Callable[[], dict[str, bytes]] | None = None,
               generation: int = 0, part: Part | None = None) -> None:
        """Write this rank's shard (and the snapshot's copy of its part of a ZeRO optimizer's state;
        on rank 0 the user's files and the `reported_files` of elastic.report, or what reads them)
        in the background, without waiting."""
        upload = _Upload(snapshot, rank, world_size, generation, functools.partial(
            self._write, snapshot, rank, world_size, stall_s, dict(user_files), dict(metadata), crash_midway,
            reported_files or {}, generation, part))
        with self._changed:
            replaced, self._waiting = self._waiting, upload
            if replaced is not None:
                replaced.snapshot.release()
                self._skipped.append(replaced.skipped(
                    f"the snapshot of step {replaced.snapshot.step} waited for the upload before it, and the one of step "
                    f"{snapshot.step} replaced it: the store is slower than the checkpoint schedule"))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="elastic-checkpoint")
                self._thread.start()
            self._changed.notify_all()

    def wait(self) -> None:
        """Return once every submitted snapshot is written or reported skipped."""
        with self._changed:
            self._changed.wait_for(lambda: self._waiting is None and not self._skipped and not self._uploading)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting is not None or self._skipped)
                skipped, self._skipped = self._skipped, []
                upload, self._waiting = self._waiting, None
                self._uploading = True
            try:
                for report in skipped:
                    self.on_written(report)
                if upload is not None:
                    upload.write()
            except Exception:  # telling the controller failed (it is gone): the next upload tries again
                _log.exception("a checkpoint report did not reach the controller")
            finally:
                if upload is not None:
                    upload.snapshot.release()
                with self._changed:
                    self._uploading = False
                    self._changed.notify_all()

    def _write(self, snapshot: Snapshot, rank: int, world_size: int, stall_s: float,
               user_files: dict[str, bytes], metadata: dict[str, Any], crash_midway: Callable[[], None] | None,
               reported_files: dict[str, bytes] | Callable[[], dict[str, bytes]], generation: int,
               part: Part | None) -> None:
        snapshot.wait_copied()
        optimizer_shard = snapshot.optimizer_shard
        started = time.perf_counter()
        folder = checkpoint_storage(self.run, snapshot.step)
        report: dict[str, Any] = {"step": snapshot.step, "rank": rank, "world_size": world_size,
                                  "generation": generation, "progress": snapshot.progress, "stall_s": stall_s,
                                  "files": []}
        try:
            self.run.fs.create_dir(folder.root, recursive=True)
            index, count = (part.index, part.count) if part else (rank, world_size)
            chunks = shard_chunks(snapshot, index, count)
            shard = tensor_file.encode({dtype: [chunk] for dtype, chunk in chunks.items()},
                                       snapshot.structure if index == 0 else None,
                                       {"format_version": str(FORMAT_VERSION), "rank": str(index),
                                        "world_size": str(count)})
            crash = (sum(c.numel() * c.element_size() for c in chunks.values()) // 2, crash_midway) if crash_midway else None
            name = f"{part.name}/{shard_name(index, count)}" if part else shard_name(rank, world_size)

            def write(name: str, pieces: list[Any], crash: tuple[int, Callable[[], None]] | None = None) -> None:
                report["files"].append(write_file(folder, name, pieces, crash, generation_path(generation, name, self.attempt)))

            write(name, shard, crash)
            if optimizer_shard is not None:
                structure, tensors = describe(optimizer_shard)
                write(optimizer_shard_name(rank, world_size), tensor_file.encode(tensors, structure))
            if rank == 0:
                for name, data in user_files.items():
                    write(f"{USER_FILES}/{name}", [data])
                for name, data in (reported_files() if callable(reported_files) else reported_files).items():
                    write(f"{REPORTED}/{name}", [data])
                report["metadata"] = metadata
        except Exception as exc:  # any storage error: the checkpoint stays incomplete, training goes on
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["upload_s"] = time.perf_counter() - started
        self.on_written(report)


@dataclass
class _Upload:
    """A snapshot waiting for the writer's thread: what names it, and the write itself."""

    snapshot: Snapshot
    rank: int
    world_size: int
    generation: int
    write: Callable[[], None]

    def skipped(self, why: str) -> dict[str, Any]:
        return {"step": self.snapshot.step, "rank": self.rank, "world_size": self.world_size,
                "generation": self.generation, "skipped": why}


def file_path(entry: dict[str, Any]) -> str:
    """Where a manifest entry's bytes lie in the checkpoint's folder."""
    return entry.get("path", entry["name"])


def generation_path(generation: int, name: str, attempt: str = "") -> str:
    """Where generation `generation` of the fit() `attempt` writes the file `name` of a checkpoint:
    another attempt's (one resumed by name after a restart, or a second run given the same name)
    never overwrites a file a manifest lists."""
    return f"gen-{generation}-{attempt[:8]}/{name}" if attempt else f"gen-{generation}/{name}"


def write_file(folder: RunStorage, name: str, pieces: list[Any],
               crash: tuple[int, Callable[[], None]] | None = None, path: str | None = None) -> dict[str, Any]:
    """Write file `name` (at `path`, by default the name), the `pieces` end to end, and make it
    durable; its manifest entry (name, path, size, sha256).

    The pieces go to storage as they are, in parts of HASH_PART_BYTES, each hashed on a helper
    thread while this one writes it (both let go of the GIL): with a free core the hash costs
    little more than the write. `crash` is an injected fault, (bytes, die): once that many bytes
    have reached storage, `die` ends the process like a crash (`elastic.worker.injection.die`).
    """
    relative = path or name
    if "/" in relative:
        folder.fs.create_dir(folder.path(relative.rsplit("/", 1)[0]), recursive=True)
    path = folder.path(relative)
    views = [memoryview(piece).cast("B") for piece in pieces]
    parts = [view[start:start + HASH_PART_BYTES] for view in views for start in range(0, len(view), HASH_PART_BYTES)]
    sha256 = hashlib.sha256()
    size = 0
    local = isinstance(folder.fs, pafs.LocalFileSystem)
    # A local file is written with Python's own I/O: it lets go of the GIL while it writes, so
    # the hash runs meanwhile (measured: pyarrow's local stream does not), and it can fsync.
    with (open(path, "wb") if local else folder.fs.open_output_stream(path)) as out, \
            ThreadPoolExecutor(1, thread_name_prefix="elastic-checkpoint-hash") as hasher:
        for part in parts:
            hashed = hasher.submit(sha256.update, part)
            if crash is not None and size + len(part) >= crash[0]:
                out.write(part[: crash[0] - size])
                out.flush()
                crash[1]()
            out.write(part)
            size += len(part)
            hashed.result()
        if local:
            out.flush()
            os.fsync(out.fileno())
    return {"name": name, "path": relative, "size": size, "sha256": sha256.hexdigest()}


def _fsync(fs: pafs.FileSystem, path: str) -> None:
    """Flush a local file, or a local folder's entries, to the disk; an object store's upload
    is durable once it returns."""
    if isinstance(fs, pafs.LocalFileSystem):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
