"""The TCP connections of one generation's gloo groups, which a survivor can sever.

A peer that dies closes its sockets, and gloo fails every operation waiting on it. A peer cut
off by the network (a link down, a switch rebooting, a NIC reset) sends nothing: the
operations waiting on it block in gloo's C++ until the collective timeout, and neither
`ProcessGroupGloo.abort()` nor a Python thread can interrupt them (checked on torch 2.13:
abort returns, the all-reduce stays blocked). Shutting the connections down from this side
can: gloo's event loop sees the socket close and fails whatever waits on it with "Connection
closed by peer", which `elastic.group.is_peer_failure` already reads as a peer failure.

`GroupLinks.opened_by(connect)` records the sockets that `connect` (forming the generation's
groups) opened in this process; `sever()` shuts down the connected ones. Listening sockets are
left alone: gloo's listener aborts the process when its accept fails. The group itself is then
dropped as after any broken generation (`elastic.group.leave_group`).
"""

from __future__ import annotations

import os
import socket
from typing import Callable

_FD_DIR = "/proc/self/fd"


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> one fd open on it (Linux; empty elsewhere)."""
    sockets: dict[int, int] = {}
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return sockets
    for fd in fds:
        try:
            target = os.readlink(f"{_FD_DIR}/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            sockets[int(target[len("socket:["):-1])] = int(fd)
    return sockets


class GroupLinks:
    """The sockets one generation's groups opened, by inode: fd numbers are reused, inodes are not."""

    def __init__(self, inodes: frozenset[int]) -> None:
        self.inodes = inodes

    @classmethod
    def opened_by(cls, connect: Callable[[], None]) -> "GroupLinks":
        before = set(_socket_fds())
        connect()
        return cls(frozenset(set(_socket_fds()) - before))

    def sever(self) -> int:
        """Shut down every connection of these groups still open; the number shut down."""
        severed = 0
        for inode, fd in _socket_fds().items():
            if inode not in self.inodes:
                continue
            try:
                link = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue  # closed since it was listed
            try:
                if not link.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    link.shutdown(socket.SHUT_RDWR)  # acts on the socket, not just this duplicate fd
                    severed += 1
            except OSError:
                pass  # already closed by the peer
            finally:
                link.close()
        return severed
