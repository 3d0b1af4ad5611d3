"""The hierarchical all-reduce of a generation whose ranks share nodes: sum within each node
first, then across the nodes, so that each node sends the gradient out once.

A flat ring over 2 nodes of 2 ranks sends 1.5 times the gradient out of each node (each rank
sends 2(W-1)/W of it to the next, and two of the four hops cross the nodes), and more where a
node's ranks are not neighbours in the ring. Here the ranks of each node reduce onto its
leader (its lowest rank) over the node's own loopback, the leaders all-reduce across the nodes,
and each leader broadcasts the sum back within its node. Nodes may hold unequal numbers of
ranks (2 + 1 after a death): a node of one rank is its own leader.

Each generation forms the subgroups of its placement (`GenerationSpec.nodes`) right after its
world group, in the same order on every rank, and lets go of them with it (`release`, for
`leave_group`). It is built where it pays (`fits`): on gloo, with ranks on two nodes or more and
a node holding two or more.

Order. DDP launches its buckets one after another and gloo completes them on several threads,
so bucket 2's reduce can finish before bucket 1's on one rank and after it on another. A gloo
group matches collectives by the order they were issued in, and a mismatch of sizes kills the
process. So each stage issues its collectives in call order (`_after`): bucket k's cross-node
all-reduce waits for bucket k's reduce and for bucket k-1's all-reduce to have been issued. Each
stage has a group of its own (a node's reduce and broadcast are two groups of the same ranks),
so no stage's order depends on another's timing; and once a stage fails nothing more is issued,
since a rank that skipped a collective its peers issued would misalign all the later ones.

May import what `elastic.comm.group` may, and that module.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic.comm.group import PEER_ABORT_MARKER, GenerationSpec

Collective = Callable[[torch.Tensor, dist.ProcessGroup], dist.Work]


def fits(spec: GenerationSpec) -> bool:
    """Reducing within the nodes first saves traffic between them: gloo, ranks on two nodes or more,
    and a node holding two or more."""
    ranks_per_node = Counter(spec.nodes)
    return spec.backend == "gloo" and len(ranks_per_node) >= 2 and max(ranks_per_node.values()) >= 2


class HierarchicalAllReduce:
    """One generation's sum within the nodes, then across them: this rank's stages and their groups."""

    def __init__(self, spec: GenerationSpec) -> None:
        """Form the subgroups of `spec.nodes`: a collective of every rank of the generation, right
        after its world group formed (in the same connect, whose sockets a heal severs)."""
        nodes: dict[int, list[int]] = {}
        for rank, node in enumerate(spec.nodes):
            nodes.setdefault(node, []).append(rank)
        mine = nodes[spec.nodes[spec.rank]]
        self._lock = threading.Lock()
        self._groups: dict[str, dist.ProcessGroup] = {}  # this rank's, by stage; emptied by `release`
        self._failed: BaseException | None = None
        self.calls = 0  # all-reduces that went through the hierarchy
        # Every rank creates every group, in the same order; new_group sorts their ranks, so each
        # node's leader, its lowest rank, is rank 0 of its node's groups.
        for ranks in nodes.values():
            if len(ranks) > 1:
                self._subgroup("reduce", ranks, spec)
                self._subgroup("broadcast", ranks, spec)
        self._subgroup("across", [ranks[0] for ranks in nodes.values()], spec)
        self._stages: list[tuple[str, Collective]] = []
        if len(mine) > 1:
            self._stages.append(("reduce", lambda t, g: dist.reduce(t, group=g, group_dst=0, async_op=True)))
        if spec.rank == mine[0]:
            self._stages.append(("across", lambda t, g: dist.all_reduce(t, group=g, async_op=True)))
        if len(mine) > 1:
            self._stages.append(("broadcast", lambda t, g: dist.broadcast(t, group=g, group_src=0, async_op=True)))
        # Per stage: the last call's collective was issued (or given up).
        self._issued = {stage: _completed(None) for stage, _ in self._stages}

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum `tensor` across the generation in place: a future of it, as `flat_all_reduce` gives."""
        self.calls += 1
        with self._lock:
            failed = self._failed
        if failed is not None:
            # At once, not behind the stages: a stage whose last collective never completes (its
            # group was shut down, `leave_group`) would never start this call's.
            summed: torch.futures.Future = torch.futures.Future()
            summed.set_exception(failed)
            return summed
        summed = _completed(tensor)
        for stage, collective in self._stages:
            summed = self._after(summed, stage, collective)
        return summed

    def abort(self, reason: str) -> None:
        """Issue nothing more, from any thread: later all-reduces fail at once. The pending ones
        are failed by the `GradientAllReduce` that calls this one (`GenerationGroup.abort`)."""
        self._fail(RuntimeError(reason))

    def release(self) -> list[dist.ProcessGroup]:
        """Hand over this rank's subgroups, for `leave_group` to let go of; every later all-reduce fails."""
        with self._lock:
            held, self._groups = list(self._groups.values()), {}
        self.abort(f"{PEER_ABORT_MARKER}: the generation's groups were left")
        return held

    def _subgroup(self, stage: str, ranks: list[int], spec: GenerationSpec) -> None:
        # Connecting is bounded as the world group's is (`form_group`); collectives by the run's timeout.
        group = dist.new_group(ranks, timeout=timedelta(seconds=min(spec.connect_timeout_s, spec.collective_timeout_s)))
        if spec.rank in ranks:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=spec.collective_timeout_s), group)
            self._groups[stage] = group

    def _after(self, ready: torch.futures.Future, stage: str, collective: Collective) -> torch.futures.Future:
        """`stage`'s collective on the tensor `ready` gives, issued once `ready` completed and the
        stage's previous collective was issued: a future of the tensor once it completed."""
        done: torch.futures.Future = torch.futures.Future()
        previous, issued = self._issued[stage], torch.futures.Future()
        self._issued[stage] = issued

        def start(_: torch.futures.Future) -> None:
            try:
                self._issue(stage, collective, ready.value(), done)
            except Exception as exc:  # an earlier stage failed, or this one cannot start
                self._fail(exc)
                done.set_exception(exc)
            finally:
                issued.set_result(None)

        previous.add_done_callback(lambda _: ready.add_done_callback(start))
        return done

    def _issue(self, stage: str, collective: Collective, tensor: torch.Tensor, done: torch.futures.Future) -> None:
        """Start `stage`'s collective on `tensor`, settling `done` when it completes. Under the lock,
        so that no reference to a group outlives `release` on gloo's threads, where the group's
        destructor would join the thread it runs on."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if stage not in self._groups:
                raise RuntimeError(f"{PEER_ABORT_MARKER}: the generation's groups were left")
            work = collective(tensor, self._groups[stage])
        work.get_future().add_done_callback(lambda finished: self._settle(done, tensor, finished))

    def _settle(self, done: torch.futures.Future, tensor: torch.Tensor, finished: torch.futures.Future) -> None:
        try:
            finished.value()
        except Exception as exc:
            self._fail(exc)
            done.set_exception(exc)
            return
        done.set_result(tensor)

    def _fail(self, exc: BaseException) -> None:
        """Issue nothing more in this generation: this rank now misses a collective its peers may issue."""
        with self._lock:
            self._failed = self._failed or exc


def _completed(value: object) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future
