"""A local folder behind `pyarrow.fs.PyFileSystem` whose writes wait while the store is held: a
store that stops answering (a throttled endpoint, a NAS that hangs), without Ray or a server.
Reads, listings and deletes go through at once; every write waits for `release()`."""

import threading

import pyarrow.fs as pafs


class HeldStore(pafs.FileSystemHandler):
    def __init__(self) -> None:
        self.local = pafs.LocalFileSystem()
        self._open = threading.Event()
        self._open.set()
        self.waiting = 0  # writes waiting now

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def _wait(self) -> None:
        self.waiting += 1
        self._open.wait()
        self.waiting -= 1

    def get_type_name(self) -> str:
        return "held-local"

    def normalize_path(self, path):
        return self.local.normalize_path(path)

    def equals(self, other) -> bool:
        return other is self

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("refusing to empty the root")

    def delete_file(self, path):
        self.local.delete_file(path)

    def move(self, src, dest):
        self._wait()
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        self._wait()
        self.local.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.local.open_input_stream(path)

    def open_input_file(self, path):
        return self.local.open_input_file(path)

    def open_output_stream(self, path, metadata):
        self._wait()
        return self.local.open_output_stream(path)

    def open_append_stream(self, path, metadata):
        self._wait()
        return self.local.open_append_stream(path)
