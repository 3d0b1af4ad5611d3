"""Membership generations and the torch.distributed group each one forms.

A generation g is a numbered membership: which workers, their ranks, and the key prefix of
its rendezvous in the controller's TCPStore. A worker leaves generation g by dropping its
process group (aborting it on NCCL, where destroying a group with a dead peer can hang) and
joins g+1 in the same process. Every generation has its own prefix, so keys of a broken one
never confuse the next.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# NCCL must surface a dead peer as an error instead of hanging the stream.
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")

# How long the members of a new generation wait for each other before giving up on it.
FORMATION_TIMEOUT_S = 10.0

# Substrings of errors raised when a peer of a collective is gone. gloo raises plain
# RuntimeErrors, so the message is all there is to tell a broken group from a user bug.
_PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "gloo/transport",
    "nccl communicator was aborted",
    "ncclremoteerror",
    "ncclsystemerror",
    "process group was aborted",
    "timed out",
)


@dataclass(frozen=True)
class GenerationSpec:
    """Everything a worker needs to join generation `generation` as `rank`."""

    generation: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    store_host: str
    store_port: int
    backend: str
    reason: str
    collective_timeout_s: float
    resume_from: Any = None  # a Checkpoint to restore when no member has live state to share

    @property
    def prefix(self) -> str:
        return f"generation/{self.generation}"


def is_peer_failure(exc: BaseException) -> bool:
    """True when `exc` means a peer of the collective failed, not that the user's code is wrong."""
    if isinstance(exc, dist.DistError):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(marker in message for marker in _PEER_FAILURE_MARKERS)
    return False


def set_torchrun_env(spec: GenerationSpec) -> None:
    """Expose the generation as torchrun's environment variables."""
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.local_rank),
        LOCAL_WORLD_SIZE=str(spec.local_world_size),
        GROUP_RANK=str(spec.node_rank),
        MASTER_ADDR=spec.store_host,
        MASTER_PORT=str(spec.store_port),
        TORCHELASTIC_RESTART_COUNT=str(spec.generation),
    )


class StoreClient:
    """One connection to the controller's TCPStore, reused by every generation."""

    def __init__(self) -> None:
        self._store: dist.TCPStore | None = None
        self._address: tuple[str, int] | None = None

    def get(self, host: str, port: int) -> dist.TCPStore:
        if self._address != (host, port):
            self._store = dist.TCPStore(
                host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
            )
            self._address = (host, port)
        return self._store


def form_group(spec: GenerationSpec, store: dist.TCPStore) -> None:
    """Initialise the default process group of generation `spec.generation`.

    The rendezvous is bounded by FORMATION_TIMEOUT_S, so a member that never arrives fails the
    formation (and the controller offers another) instead of holding the others for the long
    collective timeout, which applies once the group exists.
    """
    leave_group(spec.backend)
    set_torchrun_env(spec)
    dist.init_process_group(
        spec.backend,
        store=dist.PrefixStore(spec.prefix, store),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=min(FORMATION_TIMEOUT_S, spec.collective_timeout_s)),
    )
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=spec.collective_timeout_s))


def leave_group(backend: str) -> None:
    """Drop the current process group, if any, without waiting on peers that may be dead.

    The caller must hold no reference to the group (a DDP wrapper, a pending Work): its
    sockets close only when the group object is freed, and until then a live peer blocked in a
    collective with this rank waits for the whole collective timeout instead of failing at once.
    """
    if not dist.is_initialized():
        return
    if backend == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    gc.collect()  # DDP sits in reference cycles; free the group now, closing its connections
