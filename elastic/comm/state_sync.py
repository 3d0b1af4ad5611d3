"""Healing state sync: the most advanced rank broadcasts its state to every other rank.

After a generation forms, the ranks all-gather how many steps each has committed. The rank
furthest ahead (the lowest such rank on a tie) is the source. It sends the structure of its
state (without tensor data) as one small object, then the tensor data as one flat buffer per
dtype, which every other rank loads in place. A newcomer (step 0) therefore receives the
model, optimizer and data cursor of the live ranks; a survivor that missed the last step
catches up; nobody reads storage. When every rank already holds the live state of the
same step (a heal in which no survivor was a step ahead), nothing but the steps is sent.

What is synced is the run's `RunState`: one registry of the run's state holders, each a named
attribute whose name is also its key in a sync's payload and in a checkpoint, with the kind of
state it holds (`ENTRIES`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from elastic.comm.flat_state import buffer_dtype, flatten, unflatten
from elastic.comm.generation import collectives_landed
from elastic.errors import ElasticError


@dataclass(frozen=True)
class SyncResult:
    source_rank: int
    step: int
    steps_before: list[int]
    held: bool  # some rank held the run's live state: a heal or a grow, not a start or a restart


StateKind = Literal["replicated", "per-rank", "sharded"]


@dataclass(frozen=True)
class Entry:
    """One state holder of the run: `name` is its attribute on `RunState`, its name in a sync's payload
    and its key in a checkpoint (the checkpoint format: never renamed, or older checkpoints stop loading)."""

    name: str
    kind: StateKind  # replicated: the same on every rank, sent whole by the sync; see `holds` for the exceptions
    holds: str


# Every state holder elastic registers, in the order a sync and a checkpoint take them; the train
# loop's own (`ctx.register_state`) come after them, replicated.
ENTRIES: tuple[Entry, ...] = (
    Entry("rng", "replicated", "the process's random generators (`elastic.worker.random_state.RandomState`)"),
    Entry("model", "replicated", "the prepared model's module, or this worker's part of its replica's; under "
          "ZeRO-2/3 only its buffers (`ShardedBuffers`): the parameters are sharded, moved by ZeRO"),
    Entry("powersgd", "replicated", "PowerSGD's Qs and iteration; its error buffers are per-rank (`RankState`)"),
    Entry("stale", "replicated", "stale synchrony's averaged gradients still to apply"),
    Entry("outer_sync", "replicated", "local SGD's outer optimizer, DiLoCo's, EASGD's center"),
    Entry("optimizer", "replicated", "the prepared optimizer (an `AwaitedState` until its first step prepares it); "
          "per-rank under local SGD (its inner state); absent under ZeRO, whose shards are sharded state"),
    Entry("grad_scaler", "replicated", "fp16's loss scaler"),
    Entry("data_stream", "replicated", "an iterable dataset's position (`StreamLoader`)"),
)
_NAMES = frozenset(entry.name for entry in ENTRIES)


class RunState:
    """What a generation syncs and a checkpoint holds: the run's state holders by name, each one a
    tensor or anything with `state_dict`/`load_state_dict`. An entry that is None is not held (a
    technique the run leaves off, a model not prepared yet). Each collaborator sets the entry it
    makes (`state.model = ...`); the sync and the checkpoint take them all (`items()`).
    """

    def __init__(self, rng: Any) -> None:
        self.rng = rng
        self.model: Any = None
        self.powersgd: Any = None
        self.stale: Any = None
        self.outer_sync: Any = None
        self.optimizer: Any = None
        self.grad_scaler: Any = None
        self.data_stream: Any = None
        self._registered: dict[str, Any] = {}  # the train loop's own, by the name it gave

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, holder) of every holder set: elastic's in `ENTRIES`' order, then the train loop's."""
        for entry in ENTRIES:
            holder = getattr(self, entry.name)
            if holder is not None:
                yield entry.name, holder
        yield from self._registered.items()

    def holder(self, name: str) -> Any:
        """The holder registered as `name` (a name read from a payload or a checkpoint)."""
        return getattr(self, name) if name in _NAMES else self._registered[name]

    def states(self) -> dict[str, Any]:
        """Every holder's state, by name."""
        return {name: state_of(holder) for name, holder in self.items()}

    def register(self, name: str, holder: Any) -> None:
        """The train loop's own state (`ctx.register_state`), synced and checkpointed like elastic's."""
        if name in _NAMES or name in self._registered:
            raise ElasticError(f"state {name!r} is already registered; pick another name (elastic registers 'rng', "
                               "and 'data_stream' for an iterable dataset's position)")
        self._registered[name] = holder

    def adopt_optimizer(self, optimizer: Any) -> None:
        """Register the prepared optimizer, loading the state an `AwaitedState` kept for it, if any came."""
        awaited, self.optimizer = self.optimizer, optimizer
        if isinstance(awaited, AwaitedState) and awaited.state:
            load_into(optimizer, awaited.state)


def sync_state(objects: RunState | dict[str, Any], progress: dict[str, Any], device: torch.device,
               holds_state: bool = False, group: dist.ProcessGroup | None = None) -> tuple[SyncResult, dict[str, Any]]:
    """Make every rank hold the state of the most advanced one.

    `objects` is the run's `RunState`, or a dict of names to things with `state_dict`/`load_state_dict`,
    or to tensors.
    `progress` holds plain values and must contain "step". `holds_state` says this rank
    holds the run's live state of that step (it trained in an earlier generation). Returns
    the sync result and the progress every rank now shares. Over `group` (default: WORLD),
    whose group ranks `source_rank` counts; a replica's worker syncs over its data-parallel group.
    """
    world_size = dist.get_world_size(group)
    mine = torch.tensor([progress["step"], int(holds_state)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    collectives_landed()  # on NCCL only queued: the steps read below must be whole on every rank
    steps = [int(t[0].item()) for t in gathered]
    holds = [bool(t[1].item()) for t in gathered]
    source = steps.index(max(steps))
    result = SyncResult(source_rank=source, step=steps[source], steps_before=steps, held=any(holds))
    if world_size == 1 or (all(holds) and min(steps) == max(steps)):
        # Every rank holds the live state of the same step: the same state, since every
        # step gave each of them the same all-reduced gradients. There is nothing to send.
        return result, progress

    is_source = dist.get_rank(group) == source
    source_global = dist.get_global_rank(group, source) if group is not None else source
    payload = {"progress": progress, "state": {k: state_of(v) for k, v in objects.items()}} if is_source else None
    structure, buffers = flatten(payload, device) if is_source else (None, {})
    box = [(structure, {dtype: b.numel() for dtype, b in buffers.items()})]
    dist.broadcast_object_list(box, src=source_global, group=group, device=device)
    structure, sizes = box[0]
    for dtype, size in sizes.items():
        buffer = buffers[dtype] if is_source else torch.empty(size, dtype=buffer_dtype(dtype), device=device)
        dist.broadcast(buffer, src=source_global, group=group)
        buffers[dtype] = buffer
    # Every rank, the source too (the check is a collective): nothing is loaded from a broadcast a
    # death broke off on NCCL, where it was only queued.
    collectives_landed()
    if is_source:
        return result, progress
    received = unflatten(structure, buffers)
    for name, obj in objects.items():
        load_into(obj, received["state"][name])
    return result, received["progress"]


def average_over_holders(current: Any, mine: Any | None, device: torch.device) -> Any:
    """A per-rank state averaged over the ranks that hold one, for every rank of the group.

    `current` is this rank's state as synced; `mine` is what this rank held before the sync,
    or None if it held none (a newcomer). Floating tensors become the mean over the holders;
    anything else stays as synced. A collective: every rank of the group calls it, and the
    ranks first agree that their states have one shape, since gloo kills a process whose
    collective differs in size from its peers'.
    """
    structure, buffers = flatten(current, device)
    shape = {dtype: buffer.numel() for dtype, buffer in buffers.items()}
    own = flatten(mine, device)[1] if mine is not None else None
    if own is not None and {k: v.numel() for k, v in own.items()} != shape:
        own = None  # a state of another shape (before its first step): not comparable
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, shape)
    if any(other != shape for other in shapes):
        raise ElasticError(f"the ranks' per-rank states differ in shape ({shapes}, by rank), so they cannot be "
                           "averaged; this is a bug in elastic: please report it with the run's events")
    if not buffers:
        return current
    holders = torch.tensor([float(own is not None)], dtype=torch.float64, device=device)
    dist.all_reduce(holders)
    collectives_landed()
    if holders.item() == 0:
        return current
    for dtype, buffer in buffers.items():
        if not buffer.is_floating_point():
            continue
        contribution = own[dtype] if own is not None else torch.zeros_like(buffer)
        dist.all_reduce(contribution)
        buffer.copy_(contribution.div_(holders.item()))
    collectives_landed()  # the sums, on NCCL only queued, are whole before anyone takes them
    return unflatten(structure, buffers)


def state_of(obj: Any) -> Any:
    """The state of a registered object: a tensor itself, or its state_dict()."""
    return obj.detach() if isinstance(obj, torch.Tensor) else obj.state_dict()


class AwaitedState:
    """Stands in for an object registered later (an optimizer prepared at its first step): keeps
    the state that a sync or a restored checkpoint brings for it meanwhile, which the object takes
    when it comes (`RunState.adopt_optimizer`). Empty, it gives no state, and a peer's object keeps its own."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def load_into(obj: Any, state: Any) -> None:
    """Put `state` into a registered object, in place."""
    if isinstance(state, dict) and not state and not isinstance(obj, AwaitedState):
        return  # from a peer's AwaitedState that nothing filled yet: there is no state to give
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():
            obj.copy_(state)
    else:
        obj.load_state_dict(state)
