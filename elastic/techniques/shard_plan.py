"""Where each piece of a sharded state lives, and the plan that moves the pieces when the group
changes: pure arithmetic, the same on every rank.

A sharded state (parameters, or optimizer state aligned with them) is one logical flat vector,
the tensors laid end to end. A `Layout` says which spans of it each rank of a group holds:
- `Layout.flat(Ψ)` (ZeRO-1): rank r of N holds [r·S, min((r+1)·S, Ψ)) with S = ceil(Ψ/N);
- `Layout.rows(shapes)` (ZeRO-2/3 on FSDP2): each tensor is cut along its first dimension as
  torch.chunk cuts it, rank r holding rows [r·c, min((r+1)·c, rows)) with c = ceil(rows/N),
  so one span per tensor.
A rank keeps its spans concatenated, in order, in one "local" vector per state name; the last
ranks' spans may be short or empty.

Buddies: with `replicas=k` rank r also keeps a copy of the local vectors of ranks r-1 … r-k
(mod N), so a death of up to k consecutive ranks loses nothing.

The plan (`plan_reshard`): every member of the new group says what it holds, a `ShardPosition`
or None. Each new rank needs its own spans and its buddies'. Each piece of an old rank's span
that overlaps one of them comes from the first that holds it: the receiver itself (a local
copy), the old owner, or the nearest live buddy, each piece once. No rank ever holds the whole
state. A piece without a living holder raises `ShardLostError`: the run restarts from a
checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from elastic.errors import ElasticError, StateLostError


class ShardLostError(StateLostError):
    """No live process holds a piece of the sharded state; restart from a checkpoint."""

    def __init__(self, message: str, lost_ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.lost_ranks = list(lost_ranks)

    def __reduce__(self):
        return (type(self), (self.args[0], self.lost_ranks))


@dataclass(frozen=True)
class Layout:
    """How a flat vector of `numel` elements, made of `segments` (rows, elements per row) laid end
    to end, is cut over the ranks of a group: each segment by rows, ceil(rows / N) per rank."""

    segments: tuple[tuple[int, int], ...]

    @classmethod
    def flat(cls, numel: int) -> "Layout":
        return cls(((numel, 1),))

    @classmethod
    def rows(cls, shapes: Sequence[Sequence[int]]) -> "Layout":
        return cls(tuple((shape[0], math.prod(shape[1:])) for shape in shapes))

    @property
    def numel(self) -> int:
        return sum(rows * width for rows, width in self.segments)

    def spans(self, world_size: int, rank: int) -> list[tuple[int, int]]:
        """[start, stop) of each segment's part that `rank` holds, one per segment (maybe empty)."""
        spans, offset = [], 0
        for rows, width in self.segments:
            chunk = math.ceil(rows / world_size)
            first, last = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
            spans.append((offset + first * width, offset + last * width))
            offset += rows * width
        return spans

    def length(self, world_size: int, rank: int) -> int:
        return sum(stop - start for start, stop in self.spans(world_size, rank))

    def local(self, world_size: int, rank: int, start: int, stop: int) -> slice:
        """Where flat elements [start, stop), inside one of `rank`'s spans, sit in its local vector."""
        offset = 0
        for span_start, span_stop in self.spans(world_size, rank):
            if span_start <= start and stop <= span_stop:
                return slice(offset + start - span_start, offset + stop - span_start)
            offset += span_stop - span_start
        raise ElasticError(f"elements [{start}, {stop}) are not held by rank {rank} of {world_size}")

    def overlaps(self, world_size: int, rank: int, other_size: int, other_rank: int) -> list[tuple[int, int]]:
        """The non-empty [start, stop) that `rank` of `world_size` and `other_rank` of `other_size` both hold."""
        pieces = []
        for (a, b), (c, d) in zip(self.spans(world_size, rank), self.spans(other_size, other_rank)):
            begin, end = max(a, c), min(b, d)
            if begin < end:
                pieces.append((begin, end))
        return pieces


@dataclass(frozen=True)
class ShardPosition:
    """The shard a process held: `rank` in a group of `world_size`, its own state after `steps`
    steps and its buddy copies after `buddy_steps` (None: the same; -1: no usable copy)."""

    rank: int
    world_size: int
    steps: int
    buddy_steps: int | None = None

    def holds(self, steps: int) -> list[str]:
        """Which of its copies are of the state after `steps` steps: "own", "buddies"."""
        buddy_steps = self.steps if self.buddy_steps is None else self.buddy_steps
        return [kind for kind, at in (("own", self.steps), ("buddies", buddy_steps)) if at == steps]


@dataclass(frozen=True)
class Transfer:
    """Flat elements [start, stop) of every state tensor, from group rank `source` to group rank `target`.

    The source reads its copy of old rank `owner`'s local vector. The target writes its copy of
    new rank `keeper`'s: its own if `keeper` is its new rank, else a buddy copy.
    """

    source: int
    target: int
    owner: int
    keeper: int
    start: int
    stop: int


def buddies_of(rank: int, world_size: int, replicas: int) -> list[int]:
    """The ranks whose state `rank` keeps copies of, nearest first."""
    return [(rank - j) % world_size for j in range(1, min(replicas, world_size - 1) + 1)]


def agreed_history(positions: Sequence[ShardPosition | None],
                   steps_may_differ: bool = False) -> tuple[int, int] | None:
    """(old world size, steps) that every holder agrees on; None if nobody holds state.
    With `steps_may_differ` only the group must agree, and steps is the most any holds."""
    held = [p for p in positions if p is not None]
    if not held:
        return None
    histories = {(p.world_size, 0 if steps_may_differ else p.steps) for p in held}
    ranks = sorted(p.rank for p in held)
    world_size, steps = held[0].world_size, max(p.steps for p in held)
    if len(histories) > 1 or len(set(ranks)) < len(ranks) or not all(0 <= r < world_size for r in ranks):
        raise ElasticError(
            f"The processes hold sharded state of different groups: {held}. Each must pass the "
            "position it held in the same last group, or None if it missed steps or was not in it."
        )
    return world_size, steps


def scalars_at(members: Sequence[dict], steps: int | None) -> dict:
    """The optimizer's non-sharded entries (Adam's `step`) as of `steps`, from the members'
    reports: a holder's own ("scalars") if its own shard is of that step, else those it kept with
    its buddy copies ("buddy_scalars"). After a death inside a step the survivors' own state
    may be a step ahead of the step the group resumes at."""
    held = [m for m in members if m["position"] is not None]
    for kind, key in (("own", "scalars"), ("buddies", "buddy_scalars")):
        for member in held:
            if steps is None or kind in member["position"].holds(steps):
                return member[key]
    return held[0]["scalars"] if held else {}


def plan_reshard(
    layout: Layout, positions: Sequence[ShardPosition | None], leaving: Sequence[bool], replicas: int,
    steps: int | None = None,
) -> list[Transfer]:
    """Every piece each staying rank needs and who sends it; the same list on every rank.

    `positions[g]` is what group rank g holds and `leaving[g]` says whether it leaves after
    sending. The staying ranks, in group order, become new ranks 0, 1, ... `steps` is the step
    the group resumes at: only copies of the state after that many steps are used (a death
    inside a step leaves some ranks' own shard, or their buddy copies, a step off). Raises
    `ShardLostError` if a needed piece has no holder.
    """
    history = agreed_history(positions, steps is not None)
    if history is None:
        return []
    old_size, agreed = history
    steps = agreed if steps is None else steps
    copies: dict[int, list[int]] = {}
    for g, position in enumerate(positions):
        if position is not None:
            held = position.holds(steps)
            owners = ([position.rank] if "own" in held else []) + (
                buddies_of(position.rank, old_size, replicas) if "buddies" in held else [])
            for owner in owners:
                copies.setdefault(owner, []).append(g)

    def source(owner: int, target: int) -> int | None:
        holders = copies.get(owner, [])
        if target in holders:
            return target
        # The owner itself, then its buddies nearest first.
        return min(holders, key=lambda g: (positions[g].rank - owner) % old_size, default=None)

    stayers = [g for g, gone in enumerate(leaving) if not gone]
    new_size = len(stayers)
    transfers, lost = [], set()
    for new_rank, target in enumerate(stayers):
        for keeper in [new_rank, *buddies_of(new_rank, new_size, replicas)]:
            for owner in range(old_size):
                for begin, end in layout.overlaps(new_size, keeper, old_size, owner):
                    sender = source(owner, target)
                    if sender is None:
                        lost.add(owner)
                    else:
                        transfers.append(Transfer(sender, target, owner, keeper, begin, end))
    if lost:
        lost_ranks = sorted(lost)
        raise ShardLostError(
            f"The sharded state of old rank(s) {lost_ranks} of {old_size} (after step {steps}) is "
            f"lost: neither its owner nor a buddy copy (replicas={replicas}) is in the new group. "
            "The run must restart from a checkpoint; with replicas=k, a death of up to k "
            "consecutive ranks loses nothing.",
            lost_ranks,
        )
    return transfers
