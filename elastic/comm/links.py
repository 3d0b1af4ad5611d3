"""The TCP connections of one generation's gloo groups, which a survivor can sever.

A peer that dies closes its sockets, and gloo fails every operation waiting on it. A peer cut
off by the network (a link down, a switch rebooting, a NIC reset) sends nothing: the
operations waiting on it block in gloo's C++ until the collective timeout, and neither
`ProcessGroupGloo.abort()` nor a Python thread can interrupt them (checked on torch 2.13:
abort returns, the all-reduce stays blocked). Shutting the connections down from this side
can: gloo's event loop sees the socket close and fails whatever waits on it with "Connection
closed by peer".

The kernel also says, as facts, what became of each connection (`health`): gloo closes its end
of a connection once the peer closed its own (the peer died or left the group), and a cut link
leaves sent data unacknowledged while the kernel retransmits it (TCP_INFO: `tcpi_unacked`,
`tcpi_retransmits`, `tcpi_last_ack_recv`). A peer that is alive and merely slow to read still
acknowledges (its window may be zero), so nothing is retransmitted on timeout.

`GroupLinks.opened_by(connect)` records the sockets that `connect` (forming the generation's
groups) opened in this process; `sever()` shuts down the connected ones. Listening sockets are
left alone: gloo's listener aborts the process when its accept fails. The group itself is then
dropped as after any broken generation (`elastic.comm.group.leave_group`).

`traffic()` reads what each connection sent from the kernel (TCP_INFO: bytes acknowledged, and
the time the socket was busy sending them), by peer address. A peer's link that is slow shows
as a low rate on every connection to and from it; the controller compares them
(`elastic.controller.policies.find_slow_link`), which a ring all-reduce's timings alone cannot: every rank
of the ring waits on the slowest link alike.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable

_FD_DIR = "/proc/self/fd"
# Offsets into Linux's struct tcp_info (include/uapi/linux/tcp.h, stable since 4.10):
# tcpi_state (u8) at 0, tcpi_retransmits (u8, unanswered retransmission timeouts of the oldest
# unacknowledged segment) at 2, tcpi_unacked (u32) at 24, tcpi_last_ack_recv (u32, milliseconds
# ago) at 56, tcpi_bytes_acked (u64) at 120, tcpi_busy_time (u64, microseconds) at 168.
_TCP_INFO_SIZE = 176
_STATE_AT, _RETRANSMITS_AT, _UNACKED_AT, _LAST_ACK_AT = 0, 2, 24, 56
_BYTES_ACKED_AT, _BUSY_US_AT = 120, 168
_TCP_ESTABLISHED = 1


@dataclass(frozen=True)
class LinkHealth:
    """What the kernel says of one generation's connections: how many closed since they formed
    (gloo closes its end once the peer's is closed), and, per peer address, how long data sent
    on a connection to it has gone unacknowledged while the kernel retransmits it."""

    closed: int = 0
    silent: dict[str, float] = field(default_factory=dict)

    @property
    def broken(self) -> bool:
        return self.closed > 0 or bool(self.silent)

    def describe(self) -> str:
        parts = [f"{self.closed} of its connections closed (the peer died or left)"] if self.closed else []
        parts += [f"data sent to {peer} unacknowledged for {seconds:.1f} s" for peer, seconds in sorted(self.silent.items())]
        return "; ".join(parts)


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

    def __init__(self, inodes: frozenset[int], fds: dict[int, int] | None = None,
                 connected: frozenset[int] = frozenset()) -> None:
        self.inodes = inodes
        self._fds = fds or {}  # inode -> the fd it had when the groups formed
        self._connected = connected  # the inodes that were connections (not listeners) then

    @classmethod
    def opened_by(cls, connect: Callable[[], None]) -> "GroupLinks":
        before = set(_socket_fds())
        connect()
        opened = {inode: fd for inode, fd in _socket_fds().items() if inode not in before}
        connected = frozenset(inode for inode, fd in opened.items() if _tcp_info(fd, inode) is not None)
        return cls(frozenset(opened), opened, connected)

    def health(self) -> LinkHealth:
        """What became of these groups' connections since they formed (`LinkHealth`), read from
        the kernel, from any thread. Linux only; healthy elsewhere."""
        closed, silent = 0, {}
        for inode in self._connected:
            read = _tcp_info(self._fds[inode], inode)
            if read is None:
                closed += 1  # gloo closed it, and the number may be reused
                continue
            peer, info = read
            if info[_STATE_AT] != _TCP_ESTABLISHED:
                closed += 1
                continue
            unacked, = struct.unpack_from("I", info, _UNACKED_AT)
            last_ack_ms, = struct.unpack_from("I", info, _LAST_ACK_AT)
            if unacked and info[_RETRANSMITS_AT]:
                silent[peer] = max(silent.get(peer, 0.0), last_ack_ms / 1000)
        return LinkHealth(closed, silent)

    def traffic(self) -> dict[str, tuple[int, float]]:
        """Per peer address: the bytes these groups' connections sent it (acknowledged), and the
        seconds they were busy sending, since the groups formed. Linux only; empty elsewhere."""
        sent: dict[str, tuple[int, float]] = {}
        for inode, fd in self._fds.items():
            read = _tcp_info(fd, inode)
            if read is None:
                continue
            peer, info = read
            if len(info) < _TCP_INFO_SIZE:
                continue  # a kernel older than 4.10 keeps no busy time
            acked, = struct.unpack_from("Q", info, _BYTES_ACKED_AT)
            busy_us, = struct.unpack_from("Q", info, _BUSY_US_AT)
            total_bytes, total_s = sent.get(peer, (0, 0.0))
            sent[peer] = (total_bytes + acked, total_s + busy_us / 1e6)
        return sent

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


def _tcp_info(fd: int, inode: int) -> tuple[str, bytes] | None:
    """The peer address and TCP_INFO of the connected TCP socket `inode`, open as `fd`; None if
    that fd no longer holds it, or it is no connected TCP socket (a listener, say)."""
    try:
        if os.fstat(fd).st_ino != inode:
            return None
        link = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if link.family not in (socket.AF_INET, socket.AF_INET6) or link.type != socket.SOCK_STREAM:
            return None
        return link.getpeername()[0], link.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    except OSError:
        return None  # not connected (a listener), or shut down
    finally:
        link.close()
