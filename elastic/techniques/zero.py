"""ZeRO stage 1: the optimizer state sharded across data-parallel ranks, resharded live when
the world size changes, in the same processes, point to point.

    optimizer = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    optimizer.reshard(None)            # in the first group: nobody holds state yet
    loss.backward()                    # DDP leaves the averaged gradient in every .grad
    optimizer.step()
    optimizer.zero_grad()
    previous = optimizer.position      # before leaving the group
    ...                                # the next generation's group is formed
    optimizer.reshard(previous)        # every member; a newcomer passes None

Layout. The parameters, in order, form one logical flat vector of Ψ elements. With N ranks,
rank r owns [r·S, min((r+1)·S, Ψ)) with S = ceil(Ψ/N); the last ranges may be short or empty.
Rank r runs a fresh instance of the user's optimizer class, with the same hyperparameters, on a
flat copy of its range only, so elementwise state (Adam's exp_avg and exp_avg_sq, SGD's
momentum_buffer) exists once across the group. A step copies this rank's slice of the
(already averaged) gradients into the shard, steps the inner optimizer, and one all-gather
(all_gather_into_tensor) of the shards, padded to S, writes the new parameters into the model.
Parameters stay replicated; only the optimizer state is sharded.

Buddies. With `replicas=k` (1 by default) rank r also keeps a copy of the state of ranks
r-1 … r-k (mod N). At the end of every step it sends its own state to ranks r+1 … r+k, so a
death of up to k consecutive ranks loses nothing.

Memory, for Adam in fp32 (8 bytes of state per element): replicated, every rank holds 8Ψ.
Here a rank holds 8Ψ/N of its own plus k·8Ψ/N of buddy copies, (1+k)·8Ψ/N in all, and the
buddy refresh sends k·8Ψ/N per rank per step beside the all-gather of Ψ parameters.

Reshard (the plan in `elastic/techniques/shard_plan.py`, carried out by `elastic/techniques/shard_transfer.py`, which
ZeRO-2/3 share). Every member of the new group says what it holds: a `ShardPosition` (old rank, old
world size, steps taken), or None. All ranks compute the same plan from these (`plan_reshard`).
Each new rank needs its new range and its k buddy ranges. Each piece of an old range that
overlaps one of them comes from the first of these that holds it: the receiver itself (as owner
or buddy, a local copy), the old owner, or the nearest live buddy. The pieces then move point to
point with batch_isend_irecv, each once; no rank ever holds the whole state. A rank sends just
the pieces the plan names it the source of. It receives at most (1+k)·S' elements per state
tensor, less what it already holds. At Ψ=12 with k=1 (see tests/test_zero.py): growing 2->3
sends 8 elements per state tensor, all to the newcomer. A death of rank 1 of 3 sends 8 to the
survivors. Each rank's old and new shards coexist while a reshard runs. If a piece has no
living holder, every rank raises `ShardLostError`: the run restarts from a checkpoint.

A planned shrink runs the reshard in the old group: the leaving ranks pass `leaving=True` and
only send, and the staying ranks then `bind` the smaller group. A death runs the same reshard in
the new group, without the dead; their pieces come from buddy copies.

Limits: one param group, with all parameters of one dtype and device. The inner optimizer must
be elementwise (SGD, Adam, AdamW, Adagrad, RMSprop): a per-tensor rule such as LAMB's trust
ratio would see one tensor per shard. Every parameter needs a gradient at every step.

A death inside `step()`. The own shard steps before the all-gather and the buddy copies are
refreshed after it, so a `position` names the step of each (`ShardPosition.holds`), and a
reshard at the step the group resumes at uses only copies of that step: ranks whose gather
failed after their shard stepped are served by their buddies; a refresh that broke off counts
for nothing, but the step itself is taken, since the parameters were written.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.comm.generation import collectives_landed
from elastic.errors import ElasticError
from elastic.techniques.shard_plan import (
    Layout, ShardLostError, ShardPosition, agreed_history, plan_reshard, scalars_at,
)
from elastic.techniques.shard_transfer import RankLayout, assemble, move, refreshed, wants_piece

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; pyproject allows torch 2.4.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class StateBytes:
    """Bytes of optimizer state one rank holds: its own shard and its buddy copies."""

    own: int
    buddy: int


def _rank_layout(numel: int, world_size: int, rank: int) -> RankLayout:
    return RankLayout(Layout.flat(numel), world_size, rank)


def _range(rank_layout: RankLayout, rank: int | None = None) -> tuple[int, int]:
    """[start, stop) of the flat vector that `rank` (default: this one) owns."""
    return rank_layout.layout.spans(rank_layout.world_size, rank_layout.rank if rank is None else rank)[0]


class ShardedOptimizer(torch.optim.Optimizer):
    """The user's optimizer with its state sharded across ranks (ZeRO-1); see the module docstring.

    `param_groups` holds the model's parameters and the hyperparameters, so `zero_grad()`, LR
    schedulers and step hooks work as on the wrapped optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, replicas: int = 1) -> None:
        _check_wrappable(optimizer, replicas)
        super().__init__([dict(optimizer.param_groups[0])], optimizer.defaults)
        self._sealed = True
        self._optimizer_class = type(optimizer)
        self._params: list[torch.Tensor] = list(self.param_groups[0]["params"])
        self._numel = sum(p.numel() for p in self._params)
        self._replicas = replicas
        self._layout: RankLayout | None = None
        self._group: dist.ProcessGroup | None = None  # None: the default group (WORLD)
        self._awaits_bind = False  # after a planned shrink, until `bind` names the smaller group
        self._padded: torch.Tensor | None = None  # the shard, padded to S for the all-gather
        self._shard: torch.Tensor | None = None  # the inner optimizer's only parameter
        self._inner: torch.optim.Optimizer | None = None
        self._buddies: dict[int, dict[str, torch.Tensor]] = {}
        self._steps = 0  # steps taken by this rank's own shard of the state
        self._buddy_steps = 0  # ... and by its buddy copies; -1 while (or after) they are being refreshed
        self._buddy_scalars: dict[str, Any] = {}  # the optimizer's non-sharded entries as of the buddy copies
        self._resharding = False

    @property
    def position(self) -> ShardPosition | None:
        """What this process holds, to pass to the next `reshard`; None if nothing usable (a
        reshard broke off midway)."""
        if self._layout is None or self._resharding:
            return None
        return ShardPosition(self._layout.rank, self._layout.world_size, self._steps, self._buddy_steps)

    def reshard(self, previous: ShardPosition | None, group: dist.ProcessGroup | None = None,
                leaving: bool = False, steps: int | None = None, restoring: bool = False) -> None:
        """Lay the state out over `group` (default: WORLD); a collective of all its ranks.

        `previous` is this process's `position` before the group changed, or None to hold
        nothing (a newcomer). With `leaving=True` this rank only sends and ends up holding
        nothing; the staying ranks then call `bind` on their smaller group. `steps` is the step
        the group resumes at (default: the one the holders agree on): after a death inside a
        step, only the copies of the state after that many steps are used. If nobody holds state
        at a `steps` past 0, it was lost (every holder's last reshard broke off) and
        `ShardLostError` is raised, unless `restoring` says `load_sharded` follows.
        """
        if previous is not None and previous != self.position:
            raise ElasticError(f"reshard(previous={previous}) but this optimizer holds {self.position}; "
                               "pass its position before the group changed, or None")
        own = self._own_state() if previous is not None else {}
        names = _aligned_names(own, self._shard)
        members: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, {
            "position": previous, "leaving": leaving, "numel": self._numel, "replicas": self._replicas,
            "dtypes": {name: own[name].dtype for name in names} if previous is not None else None,
            "scalars": _export_scalars(own, names) if previous is not None else None,
            "buddy_scalars": self._buddy_scalars if previous is not None else None,
        }, group=group)
        for key in ("numel", "replicas"):
            values = [m[key] for m in members]
            if len(set(values)) > 1:
                raise ElasticError(f"The ranks' optimizers differ in {key}: {values} by group rank; "
                                   "every rank must wrap the same model with the same replicas")
        stayers = [g for g, m in enumerate(members) if not m["leaving"]]
        if not stayers:
            raise ElasticError("Every rank passed leaving=True; at least one rank must keep the state")
        positions = [m["position"] for m in members]
        history = agreed_history(positions)
        if history is None and steps and not restoring:
            raise ShardLostError(f"No rank holds ZeRO-1's optimizer shards of step {steps} (a reshard broke off on "
                                 "every holder); the run must restart from a checkpoint")
        holder = next((m for m in members if m["position"] is not None), None)
        dtypes = holder["dtypes"] if holder else {}
        transfers = plan_reshard(Layout.flat(self._numel), positions, [m["leaving"] for m in members],
                                 self._replicas, steps) if dtypes else []
        self._resharding = True
        me = dist.get_rank(group)
        layout = None if leaving else _rank_layout(self._numel, len(stayers), stayers.index(me))
        received, buddies = move(transfers, me, self._layout, layout, own, self._buddies, dtypes, self._replicas,
                                 self._params[0].device, group)
        self._install(layout, received, buddies, scalars_at(members, steps),
                      steps if steps is not None else (history[1] if history else 0))
        self._resharding = False
        self._group = group
        self._awaits_bind = layout is not None and layout.world_size != dist.get_world_size(group)

    def bind(self, group: dist.ProcessGroup | None = None) -> None:
        """Step over `group` from now on, after a planned shrink that `reshard` laid out."""
        layout = self._require_layout()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (layout.world_size, layout.rank):
            raise ElasticError(
                f"bind(): this group has world_size={size}, rank={rank}, but the last reshard laid "
                f"the state out for world_size={layout.world_size}, rank={layout.rank}; form the "
                "group from the staying ranks in their old order"
            )
        self._group, self._awaits_bind = group, False

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer's signature)
        """One step of the inner optimizer on this rank's shard, then all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layout = self._require_layout()
        if self._awaits_bind:
            raise ElasticError("step() after a planned shrink needs bind(group) on the smaller group first")
        missing = [i for i, p in enumerate(self._params) if p.grad is None]
        if missing:
            raise ElasticError(f"Parameters {missing} have no gradient: ZeRO steps every parameter at every "
                               "step; pass only parameters that get a gradient, or give them zero ones")
        start, _ = _range(layout)
        _read(self._params, start, self._shard)
        self._shard.grad = _read([p.grad for p in self._params], start, torch.empty_like(self._shard))
        self._inner.param_groups[0].update(self._hyperparameters())  # LR schedulers edit param_groups
        self._inner.step()
        self._steps += 1
        gathered = self._padded.new_empty(self._padded.numel() * layout.world_size)
        _all_gather(gathered, self._padded, group=self._group)
        collectives_landed()  # on NCCL the gather is only queued: no parameter is written from half of it
        _write(gathered, self._params)
        # The step is taken: the parameters are written. A peer lost during the buddy refresh
        # leaves the copies half received, so they count for nothing, but the step commits and
        # the heal that follows finds the lost pieces elsewhere.
        self._buddy_steps = -1
        own = self._own_state()
        names = _aligned_names(own, self._shard)
        if refreshed(layout, {name: own[name] for name in names}, self._buddies, self._replicas, self._group):
            self._buddy_steps, self._buddy_scalars = self._steps, _export_scalars(own, names)
        return loss

    def skip_step(self) -> None:
        """The GradScaler skipped a step (its gradients overflowed): the state, unchanged, is now
        that of one step more, on this rank and in its buddy copies."""
        if self._buddy_steps == self._steps:
            self._buddy_steps += 1
        self._steps += 1

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard for a checkpoint: plain ints and tensors, loadable with weights_only.

        Its tensors are the live state, not copies: copy them before the next step if they are
        written in the background.
        """
        layout = self._require_layout()
        own = self._own_state()
        names = _aligned_names(own, self._shard)
        return {"numel": self._numel, "steps": self._steps, "spans": [_range(layout)],
                "tensors": {name: own[name] for name in names}, "scalars": _export_scalars(own, names)}

    def load_sharded(self, pieces: Sequence[dict[str, Any]]) -> None:
        """Rebuild this rank's shard and buddy copies from `sharded_state_dict()`s of any world size.

        Local, no communication: `pieces` must cover this rank's range and its buddies' ranges
        (passing every rank's piece always does). Call it after `reshard(None)` laid the group out.
        """
        if any("segments" in p for p in pieces):
            raise ElasticError("The pieces were written under ZeRO-2/3 (parameters and optimizer state cut by rows); "
                               "resume them with the same Strategy(zero=2 or 3)")
        layout = self._require_layout()
        if not pieces:
            raise ElasticError("load_sharded() got no pieces; pass the sharded_state_dict() of every rank")
        histories = sorted({(p["numel"], p["steps"]) for p in pieces})
        if len(histories) > 1 or histories[0][0] != self._numel:
            raise ElasticError(f"The pieces are from (numel, steps) {histories}, this model has numel "
                               f"{self._numel}; pass the pieces of one checkpoint of this model")
        dtypes = {name: tensor.dtype for name, tensor in pieces[0]["tensors"].items()}
        device = self._params[0].device
        own = assemble(pieces, layout, layout.rank, dtypes, device)
        buddies = {keeper: assemble(pieces, layout, keeper, dtypes, device) for keeper in layout.buddies(self._replicas)}
        self._install(layout, own, buddies, pieces[0]["scalars"], histories[0][1])

    def wants_piece(self, rank: int, world_size: int) -> bool:
        """Whether the piece written by `rank` of `world_size` overlaps what this rank holds (its
        shard and its buddy copies): `load_sharded` needs only those, so a restart reads no more."""
        return wants_piece(self._require_layout(), self._replicas, rank, world_size)

    def state_bytes_per_rank(self) -> StateBytes:
        """Bytes of elementwise optimizer state this rank holds, its own shard and buddy copies apart."""
        own = self._own_state()
        return StateBytes(own=sum(own[name].nbytes for name in _aligned_names(own, self._shard)),
                          buddy=sum(t.nbytes for copy in self._buddies.values() for t in copy.values()))

    def state_dict(self) -> dict[str, Any]:
        raise ElasticError("ShardedOptimizer has no whole state dict: save sharded_state_dict() on "
                           "every rank and restore with load_sharded()")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise ElasticError("ShardedOptimizer loads its state with load_sharded(), from the "
                           "sharded_state_dict() of every rank of a checkpoint")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_sealed", False):
            raise ElasticError("ShardedOptimizer steps one flat vector; add every parameter to the "
                               "wrapped optimizer before wrapping it")
        super().add_param_group(param_group)

    def _require_layout(self) -> RankLayout:
        if self._layout is None:
            raise ElasticError("This ShardedOptimizer holds no layout: call reshard() on the group first "
                               "(reshard(None) in the first group), or it left the group")
        return self._layout

    def _hyperparameters(self) -> dict[str, Any]:
        return {key: value for key, value in self.param_groups[0].items() if key != "params"}

    def _own_state(self) -> dict[str, Any]:
        return self._inner.state.get(self._shard, {}) if self._inner is not None else {}

    def _install(self, layout: RankLayout | None, own: dict[str, torch.Tensor],
                 buddies: dict[int, dict[str, torch.Tensor]], scalars: dict[str, Any], steps: int) -> None:
        self._layout, self._buddies, self._steps, self._buddy_steps = layout, buddies, steps, steps
        self._buddy_scalars = scalars
        if layout is None:
            self._padded = self._shard = self._inner = None
            return
        first = self._params[0]
        self._padded = torch.zeros(math.ceil(self._numel / layout.world_size), dtype=first.dtype, device=first.device)
        self._shard = self._padded[: layout.length()]
        self._inner = optimizer_like(self._optimizer_class, [self._shard], self._hyperparameters())
        if own or scalars:
            self._inner.state[self._shard] = {**scalars_for(self._inner, scalars), **own}


def optimizer_like(optimizer_class: type[torch.optim.Optimizer], params: list[torch.Tensor],
                   hyperparameters: dict[str, Any]) -> torch.optim.Optimizer:
    """A fresh `optimizer_class` over `params` with the user's optimizer's hyperparameters: those its
    constructor takes are passed, and all (a scheduler's `initial_lr` too) set on its param group."""
    accepted = inspect.signature(optimizer_class).parameters
    inner = optimizer_class(params, **{k: v for k, v in hyperparameters.items() if k in accepted})
    inner.param_groups[0].update(hyperparameters)
    return inner


def scalars_for(optimizer: torch.optim.Optimizer, scalars: dict[str, Any]) -> dict[str, Any]:
    """Copies of the per-parameter entries that are no shards (Adam's `step`) where `optimizer`
    keeps them: torch.optim keeps a tensor `step` on the parameter's device only if capturable
    or fused, else on the CPU."""
    group = optimizer.param_groups[0]
    device = group["params"][0].device if group.get("capturable") or group.get("fused") else torch.device("cpu")
    return {k: v.to(device, copy=True) if torch.is_tensor(v) else v for k, v in scalars.items()}


def _check_wrappable(optimizer: torch.optim.Optimizer, replicas: int) -> None:
    if isinstance(optimizer, ShardedOptimizer) or not isinstance(optimizer, torch.optim.Optimizer):
        raise ElasticError(f"ShardedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if replicas < 0:
        raise ElasticError(f"replicas={replicas}: it counts buddy copies, 0 (none) or more")
    if len(optimizer.param_groups) != 1:
        raise ElasticError(
            f"The optimizer has {len(optimizer.param_groups)} param groups; ShardedOptimizer steps one "
            "flat vector under one set of hyperparameters. Build it over all parameters in one group."
        )
    if any(optimizer.state.values()):
        raise ElasticError("The optimizer has stepped already and holds state; wrap it before its first "
                           "step, and restore a checkpoint's state with load_sharded()")
    params = optimizer.param_groups[0]["params"]
    kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
    if len(kinds) > 1:
        raise ElasticError(f"The parameters mix dtypes or devices ({', '.join(kinds)}); ShardedOptimizer "
                           "flattens them into one vector: move the model to one dtype and device")
    frozen = [i for i, p in enumerate(params) if not p.requires_grad]
    if frozen:
        raise ElasticError(f"Parameters {frozen} do not require grad; pass only trainable parameters")
    if sum(p.numel() for p in params) == 0:
        raise ElasticError("The parameters have no elements to optimize")


def _aligned_names(state: dict[str, Any], shard: torch.Tensor | None) -> list[str]:
    """The state entries that are elementwise, one value per element of the shard."""
    return sorted(name for name, value in state.items()
                  if torch.is_tensor(value) and shard is not None and value.shape == shard.shape)


def _export_scalars(state: dict[str, Any], aligned: list[str]) -> dict[str, Any]:
    """The per-shard entries that are the same on every rank (Adam's `step`), on the CPU."""
    return {name: value.detach().cpu().clone() if torch.is_tensor(value) else value
            for name, value in state.items() if name not in aligned}


def _read(tensors: Sequence[torch.Tensor], start: int, out: torch.Tensor) -> torch.Tensor:
    """Copy elements [start, start + len(out)) of `tensors` laid end to end into `out`."""
    stop, offset = start + out.numel(), 0
    for tensor in tensors:
        begin, end = max(start, offset), min(stop, offset + tensor.numel())
        if begin < end:
            out[begin - start:end - start].copy_(tensor.reshape(-1)[begin - offset:end - offset])
        offset += tensor.numel()
    return out


def _write(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `flat`'s leading elements into `tensors`, laid end to end."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
