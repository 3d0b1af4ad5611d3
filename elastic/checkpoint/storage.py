"""The run folder `{storage_path}/{name}/` on any `pyarrow.fs` filesystem.

`storage_path` is a local path or a URI that pyarrow understands (`s3://`, `gs://`, ...).
`RunStorage` is the one place that joins a folder name to `storage_path`, and it refuses any
name that would leave `storage_path` for some reader of the path (see `_check_inside`).
The folder is checked to be writable, with a marker file, before any worker starts, so a bad
path or missing credentials fail in the first second instead of after an hour of training.
"""

from __future__ import annotations

import os
import posixpath
import threading
import uuid
from urllib.parse import unquote

import pyarrow.fs as pafs

from elastic.errors import ElasticError


class StorageError(ElasticError):
    """The storage path cannot be used; the message says why and how to fix it."""


# How long the write check waits for the store: S3 clients retry for minutes by default.
ANSWER_WITHIN_S = 60.0

# The attempt of the fit() that holds the run folder, written by its controller before any worker
# starts: a worker that reads another (or none) writes nowhere (`check_shared`).
OWNER = ".owner"


class RunStorage:
    """Reads and writes files of one run folder through pyarrow.fs."""

    def __init__(self, storage_path: str, name: str, filesystem: pafs.FileSystem | None = None) -> None:
        self.uri = f"{storage_path.rstrip('/')}/{name}"
        if filesystem is None:
            try:
                filesystem, root = pafs.FileSystem.from_uri(_absolute(storage_path))
            except Exception as exc:  # pyarrow raises several types for bad URIs and credentials
                raise StorageError(
                    f"storage_path {storage_path!r} is not usable: {exc}. "
                    "Use a local path, s3://bucket/prefix or gs://bucket/prefix."
                ) from exc
        else:
            root = storage_path
        _check_inside(storage_path, root, name)
        self.fs = filesystem
        self.root = f"{root.rstrip('/')}/{name}"

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def check_writable(self, within_s: float = ANSWER_WITHIN_S) -> None:
        """Create the run folder and write, read and delete a marker file in it, within `within_s`:
        a store that takes connections and never answers (a stalled endpoint or proxy) would hold
        the caller for as long as its client retries, without a word."""
        marker = self.path(f".write-check-{uuid.uuid4().hex}")
        outcome: list[BaseException | None] = []

        def check() -> None:
            try:
                self.fs.create_dir(self.root, recursive=True)
                with self.fs.open_output_stream(marker) as out:
                    out.write(b"ok")
                self.fs.delete_file(marker)
                outcome.append(None)
            except Exception as exc:
                outcome.append(exc)

        checking = threading.Thread(target=check, daemon=True, name="elastic-storage-check")
        checking.start()
        checking.join(within_s)
        if not outcome:
            raise StorageError(f"the store of the run folder {self.uri!r} did not answer a write within {within_s:g} s: "
                               "check its endpoint and the network path to it (a proxy that holds connections, "
                               "an endpoint_override that points elsewhere)")
        if outcome[0] is not None:
            raise StorageError(
                f"cannot write to the run folder {self.uri!r}: {outcome[0]}. "
                "Check that storage_path exists, is writable and that credentials are set."
            ) from outcome[0]

    def take(self, attempt: str) -> None:
        """Mark the run folder as `attempt`'s (`OWNER`): the controller, before any worker starts."""
        try:
            self.fs.create_dir(self.root, recursive=True)
            self.write_text_atomic(OWNER, attempt)
        except Exception as exc:
            raise StorageError(
                f"the run's controller cannot write to the run folder {self.uri!r} ({exc}). On a cluster, give "
                "RunConfig(storage_path=...) a store every node shares (s3://, gs://, or NFS), and the head node "
                "its credentials") from exc

    def owner(self) -> str | None:
        """The attempt of the fit() that took the run folder last (`OWNER`), None if none did."""
        try:
            return self.read_bytes(OWNER).decode()
        except FileNotFoundError:
            return None

    def check_shared(self, attempt: str, node: str) -> str | None:
        """On a worker that writes checkpoints: the run folder here is the one the controller of
        `attempt` took (else StorageError), and this node may write to it (else what went wrong, for
        a warning: a store's passing error must not fail the run). A local storage_path on a cluster
        of several nodes is each node's own folder, and a node without the store's credentials (a
        cloud worker without an instance profile) fails every write: both lost every checkpoint
        without a word."""
        try:
            owner = self.owner()
            self.check_writable()
        except Exception as exc:
            return (f"the worker on node {node} cannot use the run folder {self.uri!r} ({exc}): its checkpoint "
                    "shards will fail to write while that lasts. Give every node of the cluster the store's "
                    "credentials (an instance profile or service account on worker nodes too)")
        if owner is None:
            raise StorageError(
                f"the run folder {self.uri!r}, seen from the worker on node {node}, is not the one the run's "
                "controller wrote to: storage_path is a local path each node has its own copy of. On a cluster "
                "of several nodes give RunConfig(storage_path=...) a store every node shares: s3://, gs://, "
                "or a shared file system (NFS)")
        if owner != attempt:
            raise StorageError(
                f"another fit() of the run took its folder {self.uri!r} (attempt {owner[:8]}, this one is "
                f"{attempt[:8]}): two runs with one name would overwrite each other's checkpoints. Give one of "
                "them another RunConfig(name=...)")
        return None

    def write_text_atomic(self, relative: str, text: str) -> None:
        target = self.path(relative)
        temporary = f"{target}.tmp-{uuid.uuid4().hex}"
        with self.fs.open_output_stream(temporary) as out:
            out.write(text.encode())
        self.fs.move(temporary, target)

    def write_bytes(self, relative: str, data: bytes) -> None:
        if "/" in relative:
            self.fs.create_dir(self.path(relative.rsplit("/", 1)[0]), recursive=True)
        with self.fs.open_output_stream(self.path(relative)) as out:
            out.write(data)

    def read_bytes(self, relative: str) -> bytes:
        with self.fs.open_input_stream(self.path(relative)) as stream:
            return stream.read()

    def list_dirs(self, relative: str) -> list[str]:
        """Names of the folders directly under `relative`; empty when it does not exist."""
        selector = pafs.FileSelector(self.path(relative), allow_not_found=True)
        return sorted(i.base_name for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.Directory)

    def size(self, relative: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""
        info = self.fs.get_file_info(self.path(relative))
        return info.size if info.type == pafs.FileType.File else None

    def delete_dir(self, relative: str) -> None:
        self.fs.delete_dir(self.path(relative))

    def read_text(self, relative: str) -> str:
        try:
            with self.fs.open_input_stream(self.path(relative)) as stream:
                return stream.read().decode()
        except FileNotFoundError:
            raise
        except OSError as exc:
            if "not found" in str(exc).lower() or "no such file" in str(exc).lower():
                raise FileNotFoundError(self.path(relative)) from exc
            raise


def _check_inside(storage_path: str, root: str, name: str) -> None:
    """Raise StorageError unless `root/name` is one place strictly inside `root` for every reader.

    Local filesystems resolve `..`; Windows and some object-store tools read `\\` as a separator;
    `FileSystem.from_uri`, URIs and object-store gateways percent-decode (`%2F` is `/`). A name is
    accepted only when all of these readings, normalised, land on the same folder inside `root`.
    """
    base = posixpath.normpath(root)
    target = posixpath.normpath(posixpath.join(base, name))
    decoded = name
    while unquote(decoded) != decoded:  # decode to a fixed point: %252F reads as %2F, then as /
        decoded = unquote(decoded)
    readings = [
        ("", name),
        ("read with '\\' as a separator, ", name.replace("\\", "/")),
        ("percent-decoded (as URIs and object stores read it), ", decoded.replace("\\", "/")),
    ]
    problem = None
    for how, reading in readings:
        resolved = posixpath.normpath(posixpath.join(base, reading))
        if any(ord(c) < 32 or ord(c) == 127 for c in reading):
            problem = f"{how}it contains a control character"
        elif resolved == base:
            problem = f"{how}it resolves to storage_path itself"
        elif not _is_below(base, resolved):
            problem = f"{how}it resolves to {resolved!r}, outside storage_path"
        elif resolved != target:
            problem = f"{how}it names {resolved!r} instead of {target!r}"
        if problem:
            break
    if problem:
        raise StorageError(
            f"folder {name!r} is not a safe folder inside storage_path {storage_path!r}: {problem}. "
            "Use a run name that is one plain folder name (letters, digits, '_', '-', '.'), e.g. 'lm-1'."
        )


def _is_below(base: str, path: str) -> bool:
    """Whether normalised `path` lies strictly below normalised folder `base`."""
    if base == ".":
        return path != ".." and not path.startswith("../") and not path.startswith("/")
    return path.startswith(base.rstrip("/") + "/") and path != base


def _absolute(storage_path: str) -> str:
    return storage_path if "://" in storage_path else os.path.abspath(os.path.expanduser(storage_path))
