"""One generation's groups as one object: what they are, how they are aborted, and why they failed.

Modelled on torchft's reconfigurable process group (`abort`, `errored`). A `GenerationGroup`
holds what generation g connected in this process: the default group, the subgroups of its sum
within the nodes (`elastic.comm.hierarchical`), its gradient all-reduces (`GradientAllReduce`)
and its connections (`GroupLinks`). Every abort of the generation goes through `abort(reason)`,
which latches the reason, fails its pending gradient all-reduces (those summing within the
nodes first too), aborts its NCCL communicator and severs its gloo connections.

Whether the generation failed is told from facts, never from the text of an exception
(`errored`):
- the controller's word: it offered a newer generation in this one's place (`abort`);
- the kernel's, on gloo: a connection of its groups closed (gloo closes its end once the peer
  died or left), or data sent on one went unacknowledged while the kernel retransmits it (a cut link);
- torch's: a `torch.distributed.DistError` (NCCL's errors, the store's), a type only torch raises.

`peer_failed(exc)` asks the generation this process is in, which the worker's membership
registers when it forms and withdraws when it leaves (torch.distributed's default group is
process-wide the same way). An exception raised while the generation's groups are sound is the
train loop's own, whatever its message says: an application error, never healed away.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from elastic.comm.group import PEER_ABORT_MARKER, GradientAllReduce, abort_communicator
from elastic.comm.hierarchical import HierarchicalAllReduce
from elastic.comm.links import GroupLinks


class GenerationGroup:
    """Generation `generation`'s groups in this process, and the latch of why they failed."""

    def __init__(self, generation: int, backend: str, world: dist.ProcessGroup, links: GroupLinks,
                 gradients: GradientAllReduce, hierarchy: HierarchicalAllReduce | None = None) -> None:
        self.generation = generation
        self.backend = backend
        self.world = world
        self.links = links
        self.gradients = gradients
        self.hierarchy = hierarchy
        self._lock = threading.Lock()
        self._aborted: str | None = None

    def abort(self, reason: str) -> None:
        """Fail whatever waits on this generation's groups, from any thread; the first reason sticks."""
        with self._lock:
            self._aborted = self._aborted or reason
        self.gradients.abort(reason)
        if self.hierarchy is not None:
            self.hierarchy.abort(reason)
        abort_communicator(self.world)
        if self.backend == "gloo":
            self.links.sever()

    def errored(self) -> str | None:
        """Why this generation's groups failed, from facts (see the module's docstring); None while sound."""
        if self._aborted is not None:
            return self._aborted
        if self.backend != "gloo":
            return None  # NCCL's sockets are its own, opened and closed as it likes: its errors are DistErrors
        health = self.links.health()
        return f"generation {self.generation}: {health.describe()}" if health.broken else None

    def release(self) -> list[Any]:
        """Stop the generation's gradient all-reduces and hand over its subgroups, for
        `elastic.comm.group.leave_group` to let go of: this process leaves the generation."""
        self.gradients.abort(f"{PEER_ABORT_MARKER}: generation {self.generation} was left")
        return self.hierarchy.release() if self.hierarchy is not None else []


_current: GenerationGroup | None = None


def enter(group: GenerationGroup | None) -> None:
    """Make `group` the generation this process is in (None: in none)."""
    global _current
    _current = group


def current() -> GenerationGroup | None:
    return _current


def peer_failed(exc: BaseException) -> bool:
    """Whether `exc` ended a collective because the generation lost a peer (it died, left, or was
    cut off, or the controller moved on), rather than being the train loop's own error."""
    if isinstance(exc, dist.DistError):
        return True
    group = _current
    return group is not None and group.errored() is not None
