"""ZeRO stages 2 and 3 on FSDP2 (`fully_shard`), resharded live when the world size changes.

    sharded = FullyShardedModel(model, stage=3, replicas=1)
    optimizer = sharded.adopt(torch.optim.AdamW(model.parameters(), lr=1e-3))
    sharded.form(None, steps=0)          # in each generation's group, every member
    loss = sharded.module(x).mean(); loss.backward(); optimizer.step()
    previous = sharded.position          # before leaving the group

Stage 2 shards gradients and optimizer state: FSDP2 reduce-scatters each unit's gradients and
keeps the parameters gathered from the forward to the backward (`reshard_after_forward=False`).
Stage 3 also frees the gathered parameters after each unit's forward and gathers them again in
the backward, so a rank holds only its shard between uses. Every parameter is cut along its
first dimension as torch.chunk cuts it; the optimizer (a fresh instance of the user's class with
the same hyperparameters) steps the local shards, so its elementwise state is sharded the same
way. The units are the root's children that hold parameters (the items of a ModuleList or
Sequential child each; children sharing a tied weight stay in the root's), then the root.

A module under FSDP2 is bound to one device mesh, so each generation builds a new one: a copy of
the model on the meta device is sharded over the new group, and every rank fills its shards.
Those come, point to point, from whoever held them (`shard_plan.Layout.rows`: one span of each
parameter per rank): the parameters and each optimizer state move together as one holding, with
a buddy copy on the next rank refreshed after every step, so a death loses nothing. At the first
formation nobody holds shards: the lowest group rank that still has the model's initial weights
broadcasts them and every rank cuts its own. Buffers are replicated state (synced like DDP's).

Memory, Adam in fp32, Ψ parameters, N ranks: a rank holds 4Ψ/N of parameters, 4Ψ/N of gradients
and 8Ψ/N of optimizer state, plus whole units while they are gathered (stage 3: one unit at a
time; stage 2: all of them from the forward to the backward), and a buddy copy of 12Ψ/N.

Limits: one param group; parameters of one dtype, with at least one dimension; an elementwise
optimizer (as ZeRO-1). FSDP2's collectives are not the
abortable ones of `elastic.comm.group`: a death is seen by gloo's connection errors, which at 2-3
ranks is immediate.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from elastic.comm.generation import collectives_landed
from elastic.errors import ElasticError
from elastic.techniques.shard_plan import Layout, ShardLostError, ShardPosition, plan_reshard, scalars_at
from elastic.techniques.shard_transfer import Holding, RankLayout, assemble, move, refreshed, wants_piece
from elastic.techniques.zero import optimizer_like, scalars_for

PARAM = "param"  # the holding's name for the parameters beside the optimizer's state names


class FullyShardedModel:
    """The model under FSDP2 and its optimizer over the shards, rebuilt for every generation."""

    def __init__(self, module: nn.Module, stage: int, replicas: int = 1) -> None:
        if stage not in (2, 3):
            raise ElasticError(f"FullyShardedModel runs ZeRO stage 2 or 3, got stage={stage}")
        params = list(module.parameters())
        _check_shardable(module, params)
        self.stage, self.replicas = stage, replicas
        self.module: nn.Module = module  # the FSDP2 module of the current generation; the given one before
        self._initial: nn.Module | None = module  # its weights until the first formation cuts them
        self._skeleton = _on_meta(module)
        self._layout = Layout.rows([p.shape for p in params])
        self._dtype, self._device = params[0].dtype, params[0].device
        self.optimizer: ShardedParamsOptimizer | None = None
        self.on_rebuilt: Callable[[nn.Module], None] | None = None  # told of each generation's module
        self._params: list[DTensor] = []  # the sharded parameters (FSDP2 swaps in unsharded ones while gathered)
        self._rank_layout: RankLayout | None = None
        self._group: dist.ProcessGroup | None = None
        self._buddies: dict[int, Holding] = {}
        self._steps = 0
        self._buddy_steps = 0
        self._buddy_scalars: dict[str, Any] = {}  # the optimizer's non-sharded entries as of the buddy copies
        self._forming = False

    def adopt(self, optimizer: torch.optim.Optimizer) -> "ShardedParamsOptimizer":
        """The optimizer the loop steps: `optimizer`'s class and hyperparameters over the shards."""
        if self.optimizer is not None:
            raise ElasticError("FullyShardedModel.adopt() was called twice; it shards one optimizer")
        given = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if self._initial is not None and given != {id(p) for p in self._initial.parameters()}:
            raise ElasticError("Under ZeRO-2/3 the optimizer must step every parameter of the prepared model "
                               "(FSDP2 shards them all together): build it over model.parameters()")
        self.optimizer = ShardedParamsOptimizer(optimizer, self)
        return self.optimizer

    @property
    def position(self) -> ShardPosition | None:
        """What this process holds, to pass to the next `form`; None if nothing usable."""
        if self._rank_layout is None or self._forming:
            return None
        return ShardPosition(self._rank_layout.rank, self._rank_layout.world_size, self._steps, self._buddy_steps)

    # --- a generation ------------------------------------------------------------------
    def form(self, previous: ShardPosition | None, steps: int, group: dist.ProcessGroup | None = None,
             pieces: Sequence[dict[str, Any]] = ()) -> None:
        """Shard the model over `group` (default: WORLD) at step `steps`; a collective of all its ranks.

        `previous` is this process's `position` before the group changed, or None (a newcomer,
        or a restart). `pieces` are a checkpoint's (`sharded_state_dict()` of its ranks) to
        restart from when nobody holds shards.
        """
        if isinstance(self.module, FSDPModule):
            self.module.reshard()  # a step that broke off may have left whole units gathered: free them
        own = self._own() if previous is not None else {}
        members: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, {
            "position": previous, "initial": self._initial is not None,
            "layout": (self._layout.segments, self.replicas),
            "dtypes": {name: t.dtype for name, t in own.items()} if previous is not None else None,
            "scalars": self._scalars() if previous is not None else None,
            "buddy_scalars": self._buddy_scalars if previous is not None else None,
        }, group=group)
        layouts = {m["layout"] for m in members}
        if len(layouts) > 1:
            raise ElasticError(f"The ranks shard different models or keep different replicas: {sorted(layouts)}; "
                               "every rank must prepare the same model with the same Strategy")
        positions = [m["position"] for m in members]
        me, size = dist.get_rank(group), dist.get_world_size(group)
        rank_layout = RankLayout(self._layout, size, me)
        self._forming = True
        holder = next((m for m in members if m["position"] is not None), None)
        if holder is not None:
            transfers = plan_reshard(self._layout, positions, [False] * size, self.replicas, steps)
            received, buddies = move(transfers, me, self._rank_layout, rank_layout, own, self._buddies,
                                     holder["dtypes"], self.replicas, self._device, group)
            scalars = scalars_at(members, steps)
        elif pieces:
            dtypes = {name: t.dtype for name, t in pieces[0]["tensors"].items()}
            received = assemble(pieces, rank_layout, me, dtypes, self._device)
            buddies = {k: assemble(pieces, rank_layout, k, dtypes, self._device)
                       for k in rank_layout.buddies(self.replicas)}
            scalars, steps = pieces[0]["scalars"], pieces[0]["steps"]
        elif steps == 0:
            (received, buddies), scalars = self._cut_initial(members, rank_layout, group), {}
        else:
            # Every holder's last formation broke off midway: the state of step `steps` is gone.
            raise ShardLostError(f"No rank holds ZeRO-{self.stage}'s shards of step {steps} (a formation broke off "
                                 "on every holder); the run must restart from a checkpoint")
        self._install(rank_layout, received, buddies, scalars, group)
        self._steps = self._buddy_steps = steps
        self._buddy_scalars = scalars
        self._forming = False

    def _cut_initial(self, members: list[Any], rank_layout: RankLayout,
                     group: dist.ProcessGroup | None) -> tuple[Holding, dict[int, Holding]]:
        """Nobody holds shards at step 0: spread the initial weights of the lowest rank that has
        them, and cut this rank's shard and its buddy copies."""
        source = next((g for g, m in enumerate(members) if m["initial"]), None)
        if source is None:
            raise ElasticError(
                "No rank holds the model's shards or its initial weights: the run lost a ZeRO-2/3 shard "
                "and has no checkpoint to restart from. Keep Strategy(zero_replicas=1), or write checkpoints "
                "(CheckpointConfig(every_steps=N)) so that a restart finds one")
        if self._initial is None:
            flat = torch.empty(self._layout.numel, dtype=self._dtype, device=self._device)
        else:
            flat = torch.cat([p.detach().reshape(-1) for p in self._initial.parameters()])
        dist.broadcast(flat, group_src=source, group=group)
        collectives_landed()  # on NCCL only queued: no shard is cut from a broadcast a death broke off

        def cut(rank: int) -> Holding:
            return {PARAM: torch.cat([flat[a:b] for a, b in self._layout.spans(rank_layout.world_size, rank)])}

        return cut(rank_layout.rank), {k: cut(k) for k in rank_layout.buddies(self.replicas)}

    def _install(self, rank_layout: RankLayout, own: Holding, buddies: dict[int, Holding],
                 scalars: dict[str, Any], group: dist.ProcessGroup | None) -> None:
        """Build this generation's FSDP2 module and optimizer and fill them with `own`."""
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, self._device.type)
        module = copy.deepcopy(self._skeleton)
        for unit in _units(module):
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.stage == 3)
        fully_shard(module, mesh=mesh, reshard_after_forward=self.stage == 3)
        module.to_empty(device=self._device)
        with torch.no_grad():
            for buffer, old in zip(module.buffers(), self.module.buffers()):
                buffer.copy_(old)
            params = list(module.parameters())
            for param, piece in zip(params, _split(own[PARAM], params)):
                param.to_local().copy_(piece)
        old = [self.module, self._params, self.optimizer.inner if self.optimizer else None]
        self.module, self._params = module, params
        self._rank_layout, self._buddies, self._group = rank_layout, buddies, group
        if self._initial is not None:
            _free(self._initial)  # its weights are in the shards now
            self._initial = None
        if self.optimizer is not None:
            self.optimizer.rebuild(params, {name: t for name, t in own.items() if name != PARAM}, scalars)
        if self.on_rebuilt is not None:
            self.on_rebuilt(module)
        # The old module, its parameters and optimizer state hold the old group through their
        # mesh: let their last reference go on a thread of its own, as `group.leave_group` does.
        threading.Thread(target=old.clear, name="elastic-leave-fsdp").start()

    # --- a step ------------------------------------------------------------------------
    def stepped(self) -> None:
        """After the optimizer stepped the shards: the step is taken; refresh the buddy copies.

        A peer lost during the refresh leaves the copies half received: they count for nothing,
        but the step commits (the shards stepped in place). The dead rank's new state then lives
        nowhere, so the heal reports it lost and the run restarts from a checkpoint: a death
        between the gradients' reduce-scatter and the end of the refresh costs a restart.
        """
        self._steps += 1
        self._buddy_steps = -1
        if refreshed(self._rank_layout, self._own(), self._buddies, self.replicas, self._group):
            self._buddy_steps, self._buddy_scalars = self._steps, self._scalars()

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """Reduce-scatter the gradients in this backward (the last micro-batch) or accumulate."""
        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(sync)

    # --- checkpoints and sizes ----------------------------------------------------------
    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards (parameters and optimizer state) for a checkpoint."""
        rank_layout = self._require_rank_layout()
        return {"numel": self._layout.numel, "segments": [list(seg) for seg in self._layout.segments],
                "steps": self._steps, "spans": [list(s) for s in self._layout.spans(rank_layout.world_size,
                                                                                    rank_layout.rank)],
                "tensors": self._own(), "scalars": self._scalars()}

    def wants_piece(self, rank: int, world_size: int) -> bool:
        """Whether a checkpoint piece of `rank` of `world_size` overlaps what this rank will hold
        in the current group (WORLD): call it before `form` lays the state out there."""
        rank_layout = RankLayout(self._layout, dist.get_world_size(), dist.get_rank())
        return wants_piece(rank_layout, self.replicas, rank, world_size)

    def check_pieces(self, pieces: Sequence[dict[str, Any]]) -> None:
        """Refuse a checkpoint's pieces of another model or another ZeRO stage layout."""
        segments = {tuple(tuple(s) for s in p.get("segments", ())) for p in pieces}
        if segments != {self._layout.segments}:
            raise ElasticError(
                "The checkpoint's sharded state does not fit this model under ZeRO-2/3: it was written "
                f"for parameter rows {sorted(segments)[:1]} but this model has {list(self._layout.segments)}; "
                "resume with the same model and Strategy(zero=2 or 3)")

    def state_bytes_per_rank(self) -> dict[str, int]:
        """Bytes this rank holds of each kind: its parameter shards, optimizer state, buddy copies."""
        own = self._own()
        return {"params": own[PARAM].nbytes,
                "optimizer": sum(t.nbytes for name, t in own.items() if name != PARAM),
                "buddy": sum(t.nbytes for copy in self._buddies.values() for t in copy.values())}

    def _own(self) -> Holding:
        """This rank's parameters and elementwise optimizer state, each as one local vector."""
        params = self._params
        own = {PARAM: torch.cat([p.to_local().detach().reshape(-1) for p in params])}
        states = [self.optimizer.inner.state.get(p, {}) for p in params] if self.optimizer and self.optimizer.inner else []
        for name in _aligned(states, params):
            own[name] = torch.cat([s[name].to_local().reshape(-1) for s in states])
        return own

    def _scalars(self) -> dict[str, Any]:
        """The per-parameter optimizer entries that are no shards (Adam's `step`), from the first."""
        inner = self.optimizer.inner if self.optimizer else None
        state = inner.state.get(self._params[0], {}) if inner is not None else {}
        return {name: v.detach().cpu().clone() if torch.is_tensor(v) else v
                for name, v in state.items() if not isinstance(v, DTensor)}

    def _require_rank_layout(self) -> RankLayout:
        if self._rank_layout is None:
            raise ElasticError("FullyShardedModel has not formed over a group yet: call form() first")
        return self._rank_layout


class ShardedBuffers:
    """The sharded model's buffers: replicated state, synced and checkpointed like a DDP model's."""

    def __init__(self, owner: FullyShardedModel) -> None:
        self._owner = owner

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._owner.module.named_buffers())

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, buffer in self._owner.module.named_buffers():
                buffer.copy_(state[name])


class ShardedParamsOptimizer(torch.optim.Optimizer):
    """The user's optimizer over the current generation's parameter shards (ZeRO-2/3).

    `param_groups` holds the shards and the hyperparameters, so `zero_grad()`, LR schedulers and
    step hooks work as on the wrapped optimizer; each generation builds a fresh inner instance.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owner: FullyShardedModel) -> None:
        if len(optimizer.param_groups) != 1:
            raise ElasticError(f"The optimizer has {len(optimizer.param_groups)} param groups; ZeRO-2/3 steps "
                               "one set of hyperparameters: build it over all parameters in one group")
        if any(optimizer.state.values()):
            raise ElasticError("The optimizer has stepped already; prepare it before its first step")
        super().__init__([dict(optimizer.param_groups[0])], optimizer.defaults)
        self._class = type(optimizer)
        self._owner = owner
        self.inner: torch.optim.Optimizer | None = None

    def rebuild(self, params: list[torch.Tensor], own: Holding, scalars: dict[str, Any]) -> None:
        """Step `params` from now on, with the elementwise state `own` (local vectors) if any."""
        self.param_groups[0]["params"] = params
        self.inner = optimizer_like(self._class, params,
                                    {k: v for k, v in self.param_groups[0].items() if k != "params"})
        if not own:
            return
        pieces = {name: _split(flat, params) for name, flat in own.items()}
        for i, param in enumerate(params):
            state = scalars_for(self.inner, scalars)
            for name, split in pieces.items():
                state[name] = DTensor.from_local(split[i].clone(), param.device_mesh, param.placements,
                                                 run_check=False, shape=param.shape, stride=param.stride())
            self.inner.state[param] = state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer's signature)
        if self.inner is None:
            raise ElasticError("The ZeRO-2/3 optimizer steps inside ctx.steps(), once a generation has formed")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        missing = [i for i, p in enumerate(self.param_groups[0]["params"]) if p.grad is None]
        if missing:
            raise ElasticError(f"Parameters {missing} have no gradient: ZeRO steps every parameter at every step "
                               "(their optimizer state is sharded with the others'); give them zero gradients")
        self.inner.param_groups[0].update({k: v for k, v in self.param_groups[0].items() if k != "params"})
        collectives_landed()  # the backward's reduce-scatter, on NCCL only queued, landed before the shards step
        self.inner.step()
        self._owner.stepped()
        return loss

    def state_bytes_per_rank(self) -> dict[str, int]:
        """Bytes this rank holds: parameter shards, optimizer state shards, buddy copies of both."""
        return self._owner.state_bytes_per_rank()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_owner", None) is not None:
            raise ElasticError("Under ZeRO-2/3 the optimizer steps every parameter in one group; add every "
                               "parameter to the wrapped optimizer before preparing it")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        raise ElasticError("Under ZeRO-2/3 the optimizer state is sharded: checkpoints save it per rank")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise ElasticError("Under ZeRO-2/3 the optimizer state is restored from a checkpoint's shards")


def _check_shardable(module: nn.Module, params: list[torch.Tensor]) -> None:
    if not params:
        raise ElasticError("The model has no parameters to shard")
    kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
    if len(kinds) > 1:
        raise ElasticError(f"The parameters mix dtypes or devices ({', '.join(kinds)}); ZeRO-2/3 needs one: "
                           "move the model to one dtype and device")
    scalars = [name for name, p in module.named_parameters() if p.dim() == 0]
    if scalars:
        raise ElasticError(f"Parameters {scalars} are 0-dimensional; FSDP2 cuts parameters along their first "
                           "dimension: give them shape (1,)")
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        raise ElasticError(f"Parameters {frozen} do not require grad; ZeRO-2/3 steps every parameter")


def _free(module: nn.Module) -> None:
    """Release the storage of `module`'s weights in place: the objects stay (the user's optimizer
    may still hold them), their data goes."""
    for tensor in [*module.parameters(), *module.buffers()]:
        tensor.data = tensor.data.new_empty(0)


def _on_meta(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device, without copying its weights."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                            for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo)


def _units(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 gathers one at a time: the root's children with parameters, the items of
    a ModuleList or Sequential child each. Children that share a parameter (tied embeddings) are
    left to the root's unit, since FSDP2 shards a parameter in one unit only."""
    candidates = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            candidates += list(child.children())
        else:
            candidates.append(child)
    owners: dict[int, int] = {}
    for unit in candidates:
        for param in unit.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [unit for unit in candidates
            if any(True for _ in unit.parameters()) and all(owners[id(p)] == 1 for p in unit.parameters())]


def _split(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` (a local vector) cut into each parameter's local shard, shaped like it."""
    pieces, offset = [], 0
    for param in params:
        local = param.to_local()
        pieces.append(flat[offset:offset + local.numel()].view(local.shape))
        offset += local.numel()
    return pieces


def _aligned(states: list[dict[str, Any]], params: list[torch.Tensor]) -> list[str]:
    """The optimizer state names that are sharded like the parameters (Adam's exp_avg, ...)."""
    if not states or not states[0]:
        return []
    return sorted(name for name, value in states[0].items()
                  if isinstance(value, DTensor) and value.shape == params[0].shape
                  and all(isinstance(state.get(name), DTensor) for state in states))
