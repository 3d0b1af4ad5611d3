"""The run folder `{storage_path}/{name}/` on any `pyarrow.fs` filesystem.

`storage_path` is a local path or a URI that pyarrow understands (`s3://`, `gs://`, ...).
The folder is checked to be writable, with a marker file, before any worker starts, so a bad
path or missing credentials fail in the first second instead of after an hour of training.
"""

from __future__ import annotations

import os
import uuid

import pyarrow.fs as pafs

from elastic.errors import ElasticError


class StorageError(ElasticError):
    """The storage path cannot be used; the message says why and how to fix it."""


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
        self.fs = filesystem
        self.root = f"{root.rstrip('/')}/{name}"

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def check_writable(self) -> None:
        """Create the run folder and write, read and delete a marker file in it."""
        marker = self.path(f".write-check-{uuid.uuid4().hex}")
        try:
            self.fs.create_dir(self.root, recursive=True)
            with self.fs.open_output_stream(marker) as out:
                out.write(b"ok")
            self.fs.delete_file(marker)
        except Exception as exc:
            raise StorageError(
                f"cannot write to the run folder {self.uri!r}: {exc}. "
                "Check that storage_path exists, is writable and that credentials are set."
            ) from exc

    def write_text_atomic(self, relative: str, text: str) -> None:
        target = self.path(relative)
        temporary = f"{target}.tmp-{uuid.uuid4().hex}"
        with self.fs.open_output_stream(temporary) as out:
            out.write(text.encode())
        self.fs.move(temporary, target)

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


def _absolute(storage_path: str) -> str:
    return storage_path if "://" in storage_path else os.path.abspath(os.path.expanduser(storage_path))
