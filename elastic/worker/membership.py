"""Membership: how this worker joins, leaves and forms generations, and what it holds meanwhile.

`Membership.join` leaves the current generation and joins the newest one the controller offers
(through the `GenerationMailbox`): it waits at the generation's barrier, connects its groups (the
prepared model's too), restores the latest checkpoint where a restart asks for it, syncs the
run's state from the member that holds the newest, and binds the prepared model to the new
groups. What a generation connected is one `GenerationGroup` (`elastic.comm.generation`):
`abort_stale_group` runs on the control thread and aborts it, which frees a train thread
blocked in its collectives. The gradient averages of the generation (DDP's comm hook, and the
replicas' own `average` and `agree`) go through it, because they must abort with it; so do the
subgroups of DDP's all-reduce where it sums within each node first (`elastic.comm.hierarchical`),
formed and let go of with the world group.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.checkpoint import Checkpoint, CheckpointError
from elastic.comm.group import (
    PEER_ABORT_MARKER,
    GenerationSpec,
    GradientAllReduce,
    StoreClient,
    form_group,
    leave_group,
    rendezvous,
)
from elastic.comm import generation as generations
from elastic.comm.generation import GenerationGroup, peer_failed
from elastic.comm.hierarchical import HierarchicalAllReduce, fits
from elastic.comm.links import GroupLinks
from elastic.comm.state_sync import AwaitedState, RunState, SyncResult, load_into, sync_state
from elastic.data.order import DataCursor
from elastic.errors import StateLostError, WorkerEvictedError
from elastic.faults import Fault
from elastic.parallel.prepared import Generation, PreparedModel, WorkerPlace
from elastic.techniques.strategy import Techniques
from elastic.worker.injection import FaultInjector
from elastic.worker.mailbox import GenerationMailbox
from elastic.worker.probe import HangProbe

_log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the run is: the optimizer steps committed and the data cursor, which a sync and a checkpoint carry."""

    seed: int
    step: int = 0
    cursor: DataCursor = field(init=False)

    def __post_init__(self) -> None:
        self.cursor = DataCursor(seed=self.seed)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cursor": self.cursor.to_dict()}

    def restart(self) -> None:
        self.step, self.cursor = 0, DataCursor(seed=self.seed)

    def load(self, progress: dict[str, Any]) -> None:
        self.step = progress["step"]
        self.cursor = DataCursor(**progress["cursor"])


class Membership:
    """This worker's generation: its spec, groups and connections, and how it moves to the next."""

    def __init__(self, mailbox: GenerationMailbox, *, place: WorkerPlace, state: RunState, progress: Progress,
                 model: Callable[[], PreparedModel], techniques: Techniques, faults: FaultInjector,
                 probe: HangProbe) -> None:
        """`place`: this worker's place in its replica and its device; `state` and `progress`: what a
        formation syncs or restores; `model`: the prepared model of the moment, which a formation binds."""
        self.mailbox = mailbox
        self._place = place
        self._state = state
        self._progress = progress
        self._model = model
        self._techniques = techniques
        self._faults = faults
        self._probe = probe
        self.spec: GenerationSpec | None = None
        self._store = StoreClient()
        self._group: GenerationGroup | None = None  # what the current generation connected
        self._hierarchical_calls = 0  # all-reduces the hierarchies of the generations left summed
        self._data_group: dist.ProcessGroup | None = None  # the replicas' group of this rank's place; None: the world
        self._last_sync: SyncResult | None = None
        self._holds_state = False  # synced in a generation before: holds the run's live state
        self._rolled_back = 0
        self.checkpoint: Checkpoint | None = None  # the checkpoint this rank restored at a restart
        # Ray Train's loop shape (`elastic.worker.loader_steps`): a failed gradient all-reduce is
        # told to this instead of raised into the loop's backward.
        self.backward_failed: Callable[[str], None] | None = None
        # There too, the weight of this rank's share of the step (`LoaderSteps.gradient_weight`),
        # applied to each gradient bucket before its all-reduce.
        self.bucket_weight: Callable[[], float] | None = None

    @property
    def rank(self) -> int:
        return self.spec.rank if self.spec else -1

    @property
    def continues_training(self) -> bool:
        """Some member of this generation held the run's live state when it formed (a heal or a grow):
        a fact every member shares, a newcomer too."""
        return self._last_sync is not None and self._last_sync.held

    @property
    def world_size(self) -> int:
        return self.spec.world_size if self.spec else 0

    @property
    def generation(self) -> int:
        return self.spec.generation if self.spec else -1

    @property
    def num_replicas(self) -> int:
        return self.world_size // self._place.shape.size

    @property
    def replica_rank(self) -> int:
        return self._place.shape.position(self.rank).replica

    @property
    def device(self) -> torch.device:
        """Where this worker computes, and the generation's collectives run (on NCCL, its GPU)."""
        return self._place.device

    @property
    def links(self) -> tuple[int, GroupLinks] | None:
        group = self._group
        return (group.generation, group.links) if group is not None else None

    @property
    def hierarchical_all_reduces(self) -> int:
        """The all-reduces of the run so far that summed within the nodes first."""
        group = self._group
        return self._hierarchical_calls + (group.hierarchy.calls if group is not None and group.hierarchy else 0)

    def store(self) -> dist.TCPStore:
        return self._store.get(self.spec.store_host, self.spec.store_port)

    def join(self, reason: str, lost: int = 0, in_block: bool = False) -> None:
        """Leave the current generation and join the newest one the controller offers.

        A generation that is aborted before every member arrived, that fails to connect, or
        whose groups fail while it forms (`peer_failed`), is given up and the next offer waited
        for; only a user error escapes. `in_block`: this rank heals from inside a between-steps
        block, which it runs again next; it declines a generation that takes in a newcomer, which
        begins at the next step and could not, and the controller heals without one.
        """
        left = time.perf_counter()
        if reason == "heal":
            self.leave()
            self.mailbox.report_broken(self.generation)
        tried = self.generation
        while True:
            spec = self.mailbox.wait_newer(tried)
            tried = spec.generation
            if in_block and spec.newcomers:
                self.mailbox.formed(spec.generation, {
                    "ok": False, "in_block": True,
                    "error": "inside a between-steps block, which a newcomer could not run again with it"})
                continue
            try:
                timings = self._form(spec, left)
            except WorkerEvictedError:
                raise
            except Exception as exc:
                state_lost = isinstance(exc, StateLostError)
                self.mailbox.formed(spec.generation, {"ok": False, "state_lost": state_lost,
                                                      "error": f"{type(exc).__name__}: {exc}"})
                if not (state_lost or isinstance(exc, _ConnectFailed) or peer_failed(exc)):
                    raise
                _log.warning("generation %d did not form (%s: %s); waiting for the next offer", spec.generation,
                             type(exc).__name__, exc)
                continue  # the controller offers another generation: a restart, if state was lost
            if timings is None:
                continue  # aborted: a member died or left before everyone arrived
            _log.info("joined generation %d (%s) as rank %d of %d at step %d in %.3f s", spec.generation, reason,
                      spec.rank, spec.world_size, self._progress.step, time.perf_counter() - left)
            self.mailbox.formed(spec.generation, {
                "ok": True, "step": self._progress.step, "steps_lost": lost + self._rolled_back, "reason": reason,
                "source_rank": self._last_sync.source_rank, **timings,
            })
            return

    def leave(self) -> None:
        # Nothing may keep the old group alive: see leave_group.
        held = self._model().unbind()
        self._data_group = None
        group, self._group = self._group, None
        generations.enter(None)
        if group is not None:
            held += group.release()
            self._hierarchical_calls += group.hierarchy.calls if group.hierarchy is not None else 0
        leave_group(self.spec.backend if self.spec else "gloo", held)

    def _form(self, spec: GenerationSpec, left: float) -> dict[str, float] | None:
        """Join `spec`'s generation and sync state; the phases' seconds, or None if it was aborted.

        `left` is when this rank stopped training (its step failed, or it reached the switch).
        """
        self.leave()
        store = self._store.get(spec.store_host, spec.store_port)
        self.spec = spec
        self._faults.at("barrier", spec.rank, self._progress.step)
        self._probe.arrived = spec.generation
        started = time.perf_counter()
        if not rendezvous(spec, store):
            return None
        self._faults.at("connect", spec.rank, self._progress.step)
        arrived = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model = self._model()
        hierarchy: list[HierarchicalAllReduce] = []

        def connect() -> None:
            form_group(spec, store)
            self._data_group = model.connect(spec)
            if self._data_group is None and self._techniques.reduces_within_nodes and fits(spec):
                hierarchy.append(HierarchicalAllReduce(spec))

        try:
            links = GroupLinks.opened_by(connect)
        except WorkerEvictedError:
            raise
        except Exception as exc:
            raise _ConnectFailed(f"generation {spec.generation} did not connect within its {spec.connect_timeout_s:.2f} s "
                                 f"deadline: {type(exc).__name__}: {exc}") from exc
        self._probe.connected = spec.generation
        # Under the hierarchy a rank learns of a death on another node only through its node's leader.
        within_nodes = hierarchy[0] if hierarchy else None
        heals_in_backward = self.backward_failed is not None
        abortable = spec.backend == "gloo" and (model.abortable or within_nodes is not None or heals_in_backward)
        gradients = GradientAllReduce(spec.generation, abortable,
                                      within_nodes.all_reduce if within_nodes is not None else None)
        self._group = GenerationGroup(spec.generation, spec.backend, dist.group.WORLD, links, gradients, within_nodes)
        generations.enter(self._group)
        hooked = abortable or self._techniques.hooks_gradients or heals_in_backward
        generation = Generation(spec, self._average, self._agree, (self, _allreduce_hook) if hooked else None,
                                self._inside_all_reduce)
        model.bind(generation)
        connected = time.perf_counter()
        progress = self._progress
        if spec.restart:
            # No member holds live state: rank 0 (each place of replica 0 in a run of replicas)
            # restores the checkpoint, or everyone starts over from step 0, and the sync below
            # spreads its state.
            progress.restart()
            if spec.resume_from is not None and spec.rank < self._place.shape.size:
                self._restore(spec.resume_from, model.part_name)
        holds_state = self._holds_state and not spec.restart
        held = self._techniques.before_sync(self._state, progress.to_dict(), holds_state)
        self._rolled_back = held.rolled_back
        # A replica's worker syncs with the same place of the other replicas only.
        sync, synced = sync_state(self._state, held.progress, self.device, holds_state, self._data_group)
        self._last_sync = model.synced(sync, synced["step"], self._state.rng)
        self._holds_state = True
        progress.load(synced)
        self._techniques.after_sync(held, self._state, synced, holds_state,
                                    spec.resume_from if spec.restart else None)
        self._probe.hooked = model.start(generation)
        self._probe.formed()
        done = time.perf_counter()
        return {"leave_s": started - left, "barrier_s": arrived - started, "connect_s": connected - arrived,
                "sync_s": done - connected}

    def _restore(self, checkpoint: Checkpoint, part: str) -> None:
        """Load a durable checkpoint into this rank; the sync then spreads it to the others."""
        state = checkpoint.load_state(part)
        # Checkpoints written before the RNG states were synced resume with this rank's streams.
        # (An AwaitedState stands for an optimizer not prepared yet: a checkpoint without one leaves it fresh.)
        missing = sorted(name for name, holder in self._state.items()
                         if name not in state and name != "rng" and not isinstance(holder, AwaitedState))
        if missing:
            raise CheckpointError(
                f"{checkpoint.path} holds no state for {missing} (it has {sorted(set(state) - {'progress'})}); "
                "register the same state as the run that wrote it, or use a new run name"
            )
        for name, holder in self._state.items():
            if name not in state:
                continue
            try:
                load_into(holder, state[name])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"{checkpoint.path} does not fit the registered {name!r}: {exc}. Resume with the same "
                    "model and optimizer definition, or use a new run name"
                ) from exc
        self._progress.load(state["progress"])
        self.checkpoint = checkpoint

    def abort_stale_group(self, newer_generation: int) -> None:
        """Abort the generation this rank is in if it is older than `newer_generation`, from the
        control thread: the train thread may wait in one of its collectives for a peer that died or
        was cut off (`GenerationGroup.abort`). The group is the one captured when it formed, so the
        one replacing it is never hit."""
        group = self._group
        if group is not None and group.generation < newer_generation:
            group.abort(f"{PEER_ABORT_MARKER}: the controller offered generation {newer_generation} "
                        f"in place of {group.generation}, which lost a member")

    def _inside_all_reduce(self) -> None:
        """Inside DDP's gradient all-reduce of a step, on its own path (`Generation.inside_all_reduce`):
        the faults injected there, then the count the hang check compares (a rank hung in its backward
        never counts it, while its peers, done computing, wait in the all-reduce)."""
        if self._faults.armed:
            self._faults.at("allreduce", self.rank, self._progress.step)
        self._probe.launched += 1

    def _average(self, flat: torch.Tensor) -> None:
        """Sum a flat gradient buffer across the replicas, abortable like DDP's all-reduce."""
        if self._faults.armed:
            self._faults.at("allreduce", self.rank, self._progress.step)
        self.launch_average(flat).wait()

    def launch_average(self, flat: torch.Tensor) -> torch.futures.Future:
        """Start summing a flat gradient buffer across the generation, abortable like DDP's
        all-reduce: its future (stale synchrony waits for it steps later)."""
        future = self._group.gradients.all_reduce(flat, self._data_group)
        self._probe.launched += 1
        return future

    def _agree(self) -> None:
        """Return once every rank of the generation averaged its gradients (see `GradientAllReduce.agree`)."""
        self._group.gradients.agree(self.store(), self._progress.step, self.spec.world_size)

    def claim(self, fault: Fault, on_fault: Callable[[Fault], None]) -> bool:
        """Claim `fault` for this rank; True once per run, for the first rank to meet it (told `on_fault`)."""
        if self.store().add(f"fault/{fault.spec()}", 1) != 1:
            return False
        on_fault(fault)
        return True


def _allreduce_hook(membership, bucket):
    """DDP's all-reduce where a technique routes it: summed within each node first where the
    generation spans nodes (`HierarchicalAllReduce`, abortable), compressed by the run's
    `GradientCompression` or `PowerSGD`; under `Strategy(overlap_optimizer=True)` each bucket's
    parameters then step. Elsewhere DDP's own all-reduce runs, with no hook.

    Unannotated on purpose: DDP rejects a hook whose annotations are strings, which
    `from __future__ import annotations` would make them.
    """
    techniques = membership._techniques
    if membership.bucket_weight is not None and (weight := membership.bucket_weight()) != 1:
        bucket.buffer().mul_(weight)
    future = techniques.all_reduce(bucket, membership._group.gradients.all_reduce)
    if membership.backward_failed is not None:
        return future.then(functools.partial(_kept_failure, membership.backward_failed, bucket.buffer()))
    return techniques.after_reduce(future, bucket)


def _kept_failure(told: Callable[[str], None], buffer: torch.Tensor, done: torch.futures.Future) -> torch.Tensor:
    """The reduced bucket; or, where the all-reduce failed, the failure told to `told` and the
    bucket as it is, so that the backward returns and the step, not the loop, sees the failure."""
    try:
        return done.value()
    except Exception as exc:
        told(f"{type(exc).__name__}: {exc}")
        return buffer


class _ConnectFailed(RuntimeError):
    """Connecting a generation's groups failed (a member died right after the barrier): the
    controller offers another."""
