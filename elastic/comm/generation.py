"""One generation's groups as one object: what they are, how they are aborted, and why they failed.

Modelled on torchft's reconfigurable process group (`abort`, `errored`). A `GenerationGroup`
holds what generation g connected in this process: the default group, the subgroups of its sum
within the nodes (`elastic.comm.hierarchical`), its gradient all-reduces (`GradientAllReduce`)
and its connections (`GroupLinks`). Every abort of the generation goes through `abort(reason)`,
which latches the reason, fails its pending gradient all-reduces (and stops those summing within
the nodes first from issuing more), and severs its gloo connections or hands its NCCL communicator
to the retirement thread (`elastic.comm.retirement`), which aborts it off the heal's path.

NCCL returns from a collective once it is queued, so a rank would step its optimizer, and commit
the step, on gradients whose all-reduce still waits on a dead peer; the abort that frees the
kernel lets the optimizer's kernels, queued behind it, run on a partial sum, a state no member
should hold. So before anything an NCCL collective wrote is committed (the optimizer's step, a
heal's state sync, ZeRO's gathered parameters, local SGD's average), the rank waits for the
collectives to land (`wait_landed`), as torchft's `should_commit` synchronizes the device before
the optimizer steps; and it waits for sends and receives until they completed (`wait_p2p`).

Whether the generation failed is told from facts, never from the text of an exception
(`errored`):
- the controller's word: it offered a newer generation in this one's place (`abort`);
- the kernel's, on gloo: a connection of its groups closed (gloo closes its end once the peer
  died or left), or data sent on one went unacknowledged while the kernel retransmits it (a cut link);
- torch's: a `torch.distributed.DistError` (NCCL's errors, the store's), a type only torch raises;
- on NCCL, the sum of a one-element all-reduce queued behind the generation's collectives
  (`wait_landed`): below the world size, the communicator was aborted before they completed.

`peer_failed(exc)` asks the generation this process is in, which the worker's membership
registers when it forms and withdraws when it leaves (torch.distributed's default group is
process-wide the same way). An exception raised while the generation's groups are sound is the
train loop's own, whatever its message says: an application error, never healed away.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any

import torch

import torch.distributed as dist

from elastic.comm.group import PEER_ABORT_MARKER, GradientAllReduce
from elastic.comm.hierarchical import HierarchicalAllReduce
from elastic.comm.links import GroupLinks
from elastic.comm.retirement import retirement


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
        self._peer_waits: _PeerWaits | None = None  # started by the first wait on sends and receives
        self._landing: _Landing | None = None  # made by the first wait for NCCL's collectives to land

    def abort(self, reason: str) -> None:
        """Fail whatever waits on this generation's groups, from any thread; the first reason sticks."""
        with self._lock:
            first = self._aborted is None
            self._aborted = self._aborted or reason
            peer_waits = self._peer_waits
        if peer_waits is not None:
            peer_waits.abort(self._aborted)
        self.gradients.abort(reason)
        if self.hierarchy is not None:
            self.hierarchy.abort(reason)
        if self.backend == "gloo":
            self.links.sever()
        elif first:
            # The captured group, never torch's current one, which may already be its replacement.
            # Its abort flag frees a kernel waiting on a dead peer; the abort itself lasts about a
            # second and runs on the retirement thread, before any batch still queued there.
            retirement.retire([self.world], urgent=True)

    def errored(self) -> str | None:
        """Why this generation's groups failed, from facts (see the module's docstring); None while sound."""
        if self._aborted is not None:
            return self._aborted
        if self.backend != "gloo":
            return None  # NCCL's sockets are its own, opened and closed as it likes: its errors are DistErrors
        health = self.links.health()
        return f"generation {self.generation}: {health.describe()}" if health.broken else None

    def wait_landed(self) -> None:
        """Return once every collective queued so far on this generation's NCCL group completed; raise
        a peer failure (the generation aborted) if the communicator was aborted before they did.

        A one-element all-reduce of ones is queued behind them: NCCL runs a communicator's kernels in
        order, and once it is aborted none of them runs to the end, so the sum reaches the world size
        only if everything queued before it completed here. The host waits for its event, which the
        control thread's abort frees when a peer died (`abort`). gloo's collectives return done or
        raise, and a group of one has no peer to wait for: nothing to wait for there.
        """
        if self.backend == "gloo" or self.world.size() == 1:
            return
        if self.errored() is not None:
            raise RuntimeError(self.errored())  # aborted: its communicator may be under abort on another thread
        if self._landing is None:
            self._landing = _Landing()
        try:
            total = self._landing.sum_after(self.world)
        except Exception as exc:  # the watchdog aborted the communicator first: the enqueue raises
            self.abort(f"generation {self.generation}: its NCCL communicator failed: {type(exc).__name__}: {exc}")
            raise RuntimeError(self.errored()) from exc
        if total != self.world.size():
            reason = (f"generation {self.generation}: its NCCL collectives did not complete (a one-element all-reduce "
                      f"queued behind them summed {total:g} of {self.world.size()}): the communicator was aborted")
            self.abort(reason)
            raise RuntimeError(self.errored())

    def release(self) -> list[Any]:
        """Stop the generation's gradient all-reduces and hand over its subgroups, for
        `elastic.comm.group.leave_group` to let go of: this process leaves the generation."""
        self.gradients.abort(f"{PEER_ABORT_MARKER}: generation {self.generation} was left")
        if self._peer_waits is not None:
            self._peer_waits.close()
        return self.hierarchy.release() if self.hierarchy is not None else []

    def wait_peers(self, works: Iterable[Any]) -> None:
        """Wait for sends and receives of this generation's groups, for as long as a collective may,
        or fail at once when the generation is aborted (see `wait_p2p`)."""
        if self.backend != "gloo":
            self._wait_nccl_peers(works)
            return
        with self._lock:
            if self._peer_waits is None:
                self._peer_waits = _PeerWaits(f"elastic-p2p-{self.generation}")
                if self._aborted is not None:
                    self._peer_waits.abort(self._aborted)
            peer_waits = self._peer_waits
        peer_waits.wait(list(works), self.world._get_backend(torch.device("cpu")).options._timeout)

    def _wait_nccl_peers(self, works: Iterable[Any]) -> None:
        """NCCL's plain wait only orders the streams. With a timeout it holds the host until the sends
        and receives completed, and raises if their communicator failed (the watchdog marks the
        works of a communicator with an error failed before it aborts it). A kernel the control
        thread's abort freed also ends the wait, without an error until the abort returns, but that
        abort latched the generation first (`abort`). Not `wait_landed`: its all-reduce is a
        collective, and not every rank sends or receives at the same points."""
        timeout = self.world._get_backend(torch.device("cuda")).options._timeout
        try:
            for work in works:
                work.wait(timeout)
        except Exception as exc:
            self.abort(f"generation {self.generation}: a send or receive did not complete: {type(exc).__name__}: {exc}")
            raise RuntimeError(self.errored()) from exc
        if self.errored() is not None:
            raise RuntimeError(self.errored())


class _Landing:
    """A generation's one-element all-reduce that says whether its NCCL collectives landed."""

    def __init__(self) -> None:
        self._ones = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()))
        self._sum = torch.zeros(1, pin_memory=True)  # read by the host once the event passed: no device wait
        self._landed = torch.cuda.Event()

    def sum_after(self, group: dist.ProcessGroup) -> float:
        """The all-reduced sum of ones across `group`, queued behind everything queued before it."""
        self._ones.fill_(1.0)
        dist.all_reduce(self._ones, group=group)
        self._sum.copy_(self._ones, non_blocking=True)
        self._landed.record()
        self._landed.synchronize()  # releases the GIL: the control thread can abort meanwhile
        return self._sum.item()


class _PeerWaits:
    """A daemon thread that waits on a generation's sends and receives for the train thread: one
    blocked on a peer that gave up outlives the generation there, until gloo's timeout ends it."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: set[_Wait] = set()
        self._aborted: str | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def wait(self, works: list[Any], timeout: Any) -> None:
        """Return once `works` completed, or raise their error, or the abort's."""
        call = _Wait(works, timeout)
        with self._lock:
            if self._aborted is not None:
                raise RuntimeError(self._aborted)
            self._waiting.add(call)
        self._queue.put(call)
        call.ended.wait()
        with self._lock:
            self._waiting.discard(call)
            aborted = self._aborted
        if call.finished and call.error is None:
            return
        if aborted is not None:
            raise RuntimeError(aborted)  # the first reason: the abort's sever may fail the works too
        raise call.error

    def abort(self, reason: str) -> None:
        with self._lock:
            self._aborted = self._aborted or reason
            waiting, self._waiting = self._waiting, set()
        for call in waiting:
            call.ended.set()

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                for work in call.works:
                    work.wait(call.timeout)
            except Exception as exc:
                call.error = exc
            call.finished = True
            call.ended.set()


class _Wait:
    """One wait on sends and receives, handed to `_PeerWaits`' thread."""

    def __init__(self, works: list[Any], timeout: Any) -> None:
        self.works, self.timeout = works, timeout
        self.ended = threading.Event()  # set when they completed or failed, or at the abort
        self.finished = False
        self.error: Exception | None = None


_current: GenerationGroup | None = None


def enter(group: GenerationGroup | None) -> None:
    """Make `group` the generation this process is in (None: in none)."""
    global _current
    _current = group


def current() -> GenerationGroup | None:
    return _current


def wait_p2p(works: Iterable[Any]) -> None:
    """Wait for point-to-point sends and receives (`dist.batch_isend_irecv`'s works) of the
    generation this process is in.

    On gloo, a send or receive's plain `wait()` lasts as long as the timeout its group connected
    with (the generation's connect deadline, a fraction of a second; a subgroup's 30 minutes),
    not the collective timeout set once it connected: a pipeline stage waiting a step's compute
    for its neighbour would time out and close the connection ("Application timeout caused pair
    closure" for every collective after it). And a send that waits for a peer's readiness is not
    failed when the generation's connections are severed: gloo waits on until that timeout,
    which held a surviving pipeline stage past the hang deadline after a node loss. So the works
    are waited for, with the run's collective timeout, on a thread of the generation's own, while
    this thread returns with their outcome or at once with the generation's abort.

    NCCL's plain `wait()` only orders streams: the host waits for the works with the timeout instead,
    so that nothing takes a half-received shard for a whole one. Outside a generation nothing
    aborts: plain waits. torch's pipeline schedules wait through this too (`elastic.parallel.pipeline`).
    """
    group = _current
    if group is None:
        for work in works:
            work.wait()
        return
    group.wait_peers(works)


def collectives_landed(*_: Any) -> None:
    """Wait for the NCCL collectives of the generation this process is in to land, or raise its
    peer failure (`GenerationGroup.wait_landed`); nothing on gloo or outside a generation. Its
    arguments are ignored, so that it can be an optimizer's step pre-hook."""
    group = _current
    if group is not None:
        group.wait_landed()


def landing_failure() -> BaseException | None:
    """`collectives_landed()` for the callers that keep a peer failure on a step or a block rather
    than raise it: the peer failure, or None once the collectives landed. Any other error raises."""
    try:
        collectives_landed()
    except Exception as exc:
        if not peer_failed(exc):
            raise
        return exc
    return None


def peer_failed(exc: BaseException) -> bool:
    """Whether `exc` ended a collective because the generation lost a peer (it died, left, or was
    cut off, or the controller moved on), rather than being the train loop's own error."""
    if isinstance(exc, dist.DistError):
        return True
    group = _current
    return group is not None and group.errored() is not None
