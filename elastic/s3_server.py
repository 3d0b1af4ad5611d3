"""A real S3-compatible server (moto, in server mode) in a process of its own, which a test can
freeze and thaw: a store that stops answering without losing data, as an endpoint that throttles
or a gateway that hangs does. A public testing tool beside `elastic.testing.NetworkCluster`.

    from elastic.s3_server import S3Server

    with S3Server() as server:                   # moto_server on a free port of 127.0.0.1
        fs = server.filesystem(request_timeout=2)
        fs.create_dir("bucket")
        server.freeze()                          # SIGSTOP: connections open, nothing answers
        server.thaw()                            # SIGCONT: it answers again, every object kept
        freeze = server.freeze_when(lambda: step_reached(40), seconds=5)   # later, on its own thread
        freeze.join(); freeze.frozen, freeze.thawed

Needs `moto[server]` (the test extra).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow.fs as pafs

START_TIMEOUT_S = 30.0


class S3Server:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        with socket.socket() as probe:
            probe.bind((host, 0))
            self.port = probe.getsockname()[1]
        self.endpoint = f"{host}:{self.port}"
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "S3Server":
        program = Path(sys.executable).with_name("moto_server")
        self._process = subprocess.Popen([str(program), "-H", self.host, "-p", str(self.port)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return self
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"{program} did not start on {self.endpoint}") from None
                time.sleep(0.1)

    def __exit__(self, *exc: Any) -> None:
        if self._process is not None:
            self.thaw()
            self._process.kill()
            self._process.wait()
            self._process = None

    @property
    def pid(self) -> int:
        assert self._process is not None, "the server is not running"
        return self._process.pid

    def freeze(self) -> None:
        """Stop the server's process: its connections stay open and nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def freeze_when(self, ready: Callable[[], bool], seconds: float) -> "Freeze":
        """Freeze for `seconds` once `ready()` holds (polled every 10 ms), on a thread of its own,
        started: a store that stops answering at a moment of the run the caller names."""
        freeze = Freeze(self, ready, seconds)
        freeze.start()
        return freeze

    def filesystem(self, **options: Any) -> pafs.S3FileSystem:
        """A pyarrow filesystem on this server (`options` as pyarrow.fs.S3FileSystem takes them)."""
        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", access_key="testing",
                                 secret_key="testing", region="us-east-1", **options)


class Freeze(threading.Thread):
    """One freeze of an `S3Server`; `frozen` and `thawed` are the Unix times it began and ended."""

    def __init__(self, server: S3Server, ready: Callable[[], bool], seconds: float) -> None:
        super().__init__(daemon=True, name="s3-server-freeze")
        self.server, self.ready, self.seconds = server, ready, seconds
        self.frozen = self.thawed = 0.0

    def run(self) -> None:
        while not self.ready():
            time.sleep(0.01)
        self.server.freeze()
        self.frozen = time.time()
        time.sleep(self.seconds)
        self.thawed = time.time()
        self.server.thaw()
