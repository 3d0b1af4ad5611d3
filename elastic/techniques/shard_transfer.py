"""Carrying out `shard_plan`'s plans on a live group: the pieces move point to point with
batch_isend_irecv, buddy copies are refreshed after a step, and a checkpoint's pieces of any
world size are assembled into what one rank holds.

A rank's holdings are dicts of state name -> local vector (`shard_plan`): its own, and one per
buddy it keeps. Every state tensor of a sharded state has the same layout, so a transfer moves
the same elements of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.comm.generation import peer_failed, wait_p2p
from elastic.errors import ElasticError
from elastic.techniques.shard_plan import Layout, Transfer, buddies_of

Holding = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RankLayout:
    """A layout as cut across one group of `world_size` ranks, seen from `rank`."""

    layout: Layout
    world_size: int
    rank: int

    def length(self, rank: int | None = None) -> int:
        return self.layout.length(self.world_size, self.rank if rank is None else rank)

    def local(self, rank: int, start: int, stop: int) -> slice:
        return self.layout.local(self.world_size, rank, start, stop)

    def buddies(self, replicas: int) -> list[int]:
        return buddies_of(self.rank, self.world_size, replicas)


def move(transfers: Sequence[Transfer], me: int, old: RankLayout | None, new: RankLayout | None,
         own: Holding, buddies: dict[int, Holding], dtypes: dict[str, torch.dtype], replicas: int,
         device: torch.device, group: dist.ProcessGroup | None) -> tuple[Holding, dict[int, Holding]]:
    """Run group rank `me`'s part of the plan: (its new own holding, its new buddy copies).

    `old` is where this rank's current `own` and `buddies` sit (None if it holds nothing),
    `new` where it is to sit (None if it leaves).
    """
    def allocate(keeper: int) -> Holding:
        return {name: torch.empty(new.length(keeper), dtype=dtype, device=device) for name, dtype in dtypes.items()}

    received = allocate(new.rank) if new else {}
    copies = {keeper: allocate(keeper) for keeper in (new.buddies(replicas) if new else [])}

    def sent(transfer: Transfer, name: str) -> torch.Tensor:
        held = own if old.rank == transfer.owner else buddies[transfer.owner]
        return held[name][old.local(transfer.owner, transfer.start, transfer.stop)]

    def landing(transfer: Transfer, name: str) -> torch.Tensor:
        into = received if transfer.keeper == new.rank else copies[transfer.keeper]
        return into[name][new.local(transfer.keeper, transfer.start, transfer.stop)]

    names = sorted(dtypes)
    ops = []
    for i, transfer in enumerate(transfers):
        for j, name in enumerate(names):
            tag = i * len(names) + j
            if transfer.source == transfer.target == me:
                landing(transfer, name).copy_(sent(transfer, name))
            elif transfer.source == me:
                ops.append(dist.P2POp(dist.isend, sent(transfer, name).contiguous(), group=group,
                                      group_peer=transfer.target, tag=tag))
            elif transfer.target == me:
                ops.append(dist.P2POp(dist.irecv, landing(transfer, name), group=group,
                                      group_peer=transfer.source, tag=tag))
    exchange(ops)
    return received, copies


def refreshed(rank_layout: RankLayout, own: Holding, buddies: dict[int, Holding], replicas: int,
              group: dist.ProcessGroup | None) -> bool:
    """`refresh_buddies` after a step; False if a peer was lost midway. The copies are then half
    received and count for nothing, while the step itself, taken already, stands."""
    try:
        refresh_buddies(rank_layout, own, buddies, replicas, group)
    except Exception as exc:
        if not peer_failed(exc):
            raise
        return False
    return True


def refresh_buddies(rank_layout: RankLayout, own: Holding, buddies: dict[int, Holding], replicas: int,
                    group: dist.ProcessGroup | None) -> None:
    """Send this rank's holding to ranks r+1..r+k and take r-1..r-k's into `buddies`."""
    names = sorted(own)
    size, rank = rank_layout.world_size, rank_layout.rank
    ops = []
    for j in range(1, min(replicas, size - 1) + 1):
        to, owner = (rank + j) % size, (rank - j) % size
        copy = buddies.get(owner)
        if copy is None or sorted(copy) != names:  # the first step creates the state
            copy = buddies[owner] = {name: own[name].new_empty(rank_layout.length(owner)) for name in names}
        for i, name in enumerate(names):
            tag = j * len(names) + i
            if own[name].numel():
                ops.append(dist.P2POp(dist.isend, own[name], group=group, group_peer=to, tag=tag))
            if copy[name].numel():
                ops.append(dist.P2POp(dist.irecv, copy[name], group=group, group_peer=owner, tag=tag))
    exchange(ops)


def piece_spans(piece: dict[str, Any]) -> list[tuple[int, int]]:
    """The flat spans a checkpoint piece holds (one [start, stop) in pieces of the flat layout)."""
    return [tuple(span) for span in piece.get("spans", [(piece.get("start"), piece.get("stop"))])]


def wants_piece(rank_layout: RankLayout, replicas: int, rank: int, world_size: int) -> bool:
    """Whether the piece written by `rank` of `world_size` overlaps what this rank holds (its own
    spans and its buddies'): a restart reads no other."""
    keepers = [rank_layout.rank, *rank_layout.buddies(replicas)]
    return any(rank_layout.layout.overlaps(rank_layout.world_size, keeper, world_size, rank) for keeper in keepers)


def assemble(pieces: Sequence[dict[str, Any]], rank_layout: RankLayout, keeper: int,
             dtypes: dict[str, torch.dtype], device: torch.device) -> Holding:
    """Rank `keeper`'s holding in `rank_layout`, copied from checkpoint pieces of any world size."""
    spans = rank_layout.layout.spans(rank_layout.world_size, keeper)
    out = {name: torch.empty(rank_layout.length(keeper), dtype=dtype, device=device) for name, dtype in dtypes.items()}
    covered = 0
    for piece in pieces:
        offset = 0
        for a, b in piece_spans(piece):
            for c, d in spans:
                begin, end = max(a, c), min(b, d)
                if begin >= end:
                    continue
                into = rank_layout.local(keeper, begin, end)
                for name in dtypes:
                    out[name][into].copy_(piece["tensors"][name][offset + begin - a:offset + end - a])
                covered += end - begin
            offset += b - a
    needed = rank_layout.length(keeper)
    if covered != needed:
        raise ElasticError(f"The checkpoint's pieces cover {covered} of the {needed} elements that rank {keeper} "
                           f"of {rank_layout.world_size} holds; pass the pieces of every rank of one checkpoint")
    return out


def exchange(ops: list[dist.P2POp]) -> None:
    if ops:
        wait_p2p(dist.batch_isend_irecv(ops))
