"""Which network interface the collective groups bind: the one that carries the Ray node's address,
and how NCCL takes ranks that share a GPU.

gloo (and NCCL's bootstrap) pick their address from the hostname unless told an interface.
Many images map the hostname to a loopback address in /etc/hosts (127.0.0.1 here, 127.0.1.1
on Debian and Ubuntu), and then every rank listens on loopback: generations across nodes never
connect ("Connection refused, remote=[127.0.0.1]"). Ray already knows the address each node is
reached at, so the worker binds the interface that carries it, unless the user chose one.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
NCCL_HOSTID = "NCCL_HOSTID"


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address`, or None if none here does."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address
               for a in addresses):
            return name
    return None


def bind_collectives_to(node_address: str) -> str:
    """Bind gloo and NCCL's bootstrap to the interface carrying `node_address`, where the user set
    no interface of their own; returns a line saying what they bind, for the worker's start event.

    Raises ValueError when the hostname resolves to loopback, the node's address is not loopback,
    and no interface holds it: the ranks would listen where no other node can reach them.
    """
    chosen = os.environ.get(GLOO_SOCKET_IFNAME)
    if chosen:
        return f"{GLOO_SOCKET_IFNAME}={chosen} (set by the user)"
    interface = interface_of(node_address)
    if interface is not None:
        os.environ[GLOO_SOCKET_IFNAME] = interface
        os.environ.setdefault(NCCL_SOCKET_IFNAME, interface)
        return f"{interface} ({node_address}, the Ray node's address)"
    hostname = socket.gethostname()
    try:
        resolved = socket.gethostbyname(hostname)
    except OSError:
        resolved = ""
    if resolved and ipaddress.ip_address(resolved).is_loopback and not ipaddress.ip_address(node_address).is_loopback:
        raise ValueError(
            f"gloo would bind {resolved} ({hostname!r} resolves to loopback), where other nodes cannot reach it, and "
            f"no interface here holds the Ray node's address {node_address}. Set {GLOO_SOCKET_IFNAME} (and "
            f"{NCCL_SOCKET_IFNAME}) to the interface other nodes reach this one on, e.g. in runtime_env's env_vars, "
            "or map the hostname to that address in /etc/hosts")
    return f"the hostname's address ({resolved or 'unresolved'}); no interface holds {node_address}"


def separate_ranks_sharing_a_gpu(worker_id: int, gpu_share: float) -> str | None:
    """Let NCCL take a worker that holds a fraction of a GPU as a host of its own.

    NCCL refuses two ranks of a communicator on one GPU of one host ("Duplicate GPU detected": the
    same host hash and bus id), which is where Ray puts workers that ask for GPU=0.5, the way a
    user with one GPU tries an elastic run before sending it to a cluster. NCCL hashes the host
    from NCCL_HOSTID where it is set, so a distinct one per worker makes each rank a host of its
    own, and the ranks talk over NCCL's network transport (sockets, on this node) instead of
    shared memory or NVLink: a mode for tests and small runs. Returns what it set, for the
    journal; None for a whole GPU, or where the user set NCCL_HOSTID.
    """
    if not 0 < gpu_share < 1 or os.environ.get(NCCL_HOSTID):
        return None
    os.environ[NCCL_HOSTID] = f"{socket.gethostname()}-elastic-worker-{worker_id}"
    return (f"worker {worker_id} holds GPU={gpu_share:g} of a GPU that other ranks share: {NCCL_HOSTID}="
            f"{os.environ[NCCL_HOSTID]} makes it a host of its own to NCCL, whose ranks then talk over its network "
            "transport (sockets), not NVLink or shared memory: a mode for tests and small runs")
