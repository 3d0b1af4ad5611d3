"""Tensor parallelism within a replica, on DTensor's `parallelize_module`, re-bindable to each generation's group.

    tp = TensorParallelModel(model, {**mlp_plan("mlp.up", "mlp.down"), **attention_plan("attn")}, size=2)
    tp.bind(tp_group)                   # every rank of the group; again in each generation's group
    optimizer = tp.adopt(torch.optim.AdamW(tp.module.parameters(), lr=1e-3))
    loss_fn(tp.module(x), y).backward()
    optimizer.step()

The plan maps module paths (as in `named_modules()`, '*' matching any one name) to torch's
parallel styles, Megatron's cut of a transformer block:
- an MLP: the first Linear colwise (each rank holds out_features/size rows of its weight and
  bias, and computes its slice of the hidden activations, to which the activation applies
  elementwise), the second rowwise (in_features/size columns; the ranks' partial sums are
  all-reduced, the bias is replicated);
- self-attention (`SelfAttention`): q, k and v colwise, so each rank holds heads/size whole heads
  (a head's rows are contiguous in each projection) and attends over them alone; the output
  projection rowwise.
Each block costs one all-reduce in the forward (the rowwise output) and one in the backward (the
gradient of the block's input, which DTensor sums where the replicated input entered). Parameters
outside the plan (norms, embeddings) stay plain tensors held whole on every rank: their gradients
are the same on every rank, since every activation gradient reaching them was summed, so the same
optimizer step keeps them equal.

Rebinding. `parallelize_module` binds a module to one device mesh: the styles' forward hooks hold
the mesh, and torch refuses to distribute a module twice. So every `bind` builds a new module from
a copy of the model on the meta device, parallelized over `DeviceMesh.from_group(group)`. What
fills it: at the first bind, the given model's weights, each rank taking its slice of rank 0's
(scattered and broadcast, as torch's `src_data_rank=0` does, so ranks built with other weights
still start alike); those full weights are then freed. At every later bind, the shards this
process already holds: the same local tensors, wrapped as DTensors on the new mesh, and the same
plain parameters. Nothing is copied or sent, and no rank ever holds the whole model again; the
cost is that a process must be the same tensor-parallel rank in every group it binds (a replica's
members survive together or leave together, so they can keep their order). A rebind at another
rank is refused: re-cutting would gather the whole model on every rank. Optimizers given to
`adopt` follow: their parameters and DTensor state (Adam's moments) are re-pointed to the new
module, keeping their local tensors. Read `tp.module` again after each bind: it is a new module.
Each bind also clears DTensor's cache of sharding decisions, which would otherwise hand back an
earlier group's mesh (it compares meshes by their ranks); its Python part is per thread, so bind on the
thread that runs the model. Torch's other DTensor caches keep each old mesh, and with it its
process group, alive: a bind leaks the previous group's object (its sockets stay open, unused).

Limits: the plan's parallel styles cut nn.Linear and nn.Embedding modules into equal slices (a
size that does not divide a cut width or a head count is refused); nn.MultiheadAttention cannot be
cut (q, k and v live in its one fused `in_proj_weight`, and its forward reads its weights directly,
bypassing the styles' hooks), hence `SelfAttention`; a weight tied between a planned module and an
unplanned one fails in the forward (a DTensor meets a plain tensor); the optimizer steps each
tensor on its own (torch's default once a parameter is a DTensor): its foreach and fused kernels
refuse plain tensors and DTensors in one call, so `adopt` refuses them.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from elastic.errors import ElasticError

Plan = Mapping[str, ParallelStyle]


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q, k and v projections, which tensor parallelism cuts by heads.

    Unlike nn.MultiheadAttention, each projection is an nn.Linear called as a module, and the
    number of heads is read from the projection's output width, so a rank holding heads/size heads
    runs this same code on its slice. Input and output: (batch, sequence, d_model).

    k_proj has no bias (as in Whisper): it would add the same q·b to every score of a query, which
    the softmax ignores, so its gradient is zero but for rounding, and Adam would scale that noise up
    to steps of lr·1e-9 that differ between any two summation orders.
    """

    def __init__(self, d_model: int, n_heads: int, *, causal: bool = False, dropout: float = 0.0,
                 bias: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ElasticError(f"d_model({d_model}) is not divisible by n_heads({n_heads}); pick n_heads dividing it")
        self.n_heads, self.head_dim, self.causal, self.dropout = n_heads, d_model // n_heads, causal, dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: all of them in the plain model, this rank's heads/size under tensor parallelism.
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                       is_causal=self.causal)
        return self.out_proj(y.transpose(1, 2).reshape(batch, length, -1))


def mlp_plan(up: str, down: str) -> dict[str, ParallelStyle]:
    """Megatron's MLP: the Linear at path `up` cut by output features, the one at `down` by input features."""
    return {up: ColwiseParallel(), down: RowwiseParallel()}


def attention_plan(path: str) -> dict[str, ParallelStyle]:
    """Megatron's self-attention for the `SelfAttention` at `path`: q, k, v cut by heads, out_proj by input features."""
    return {f"{path}.q_proj": ColwiseParallel(), f"{path}.k_proj": ColwiseParallel(),
            f"{path}.v_proj": ColwiseParallel(), f"{path}.out_proj": RowwiseParallel()}


class TensorParallelModel:
    """A model cut across a tensor-parallel group of `size` ranks by `plan`, rebuilt over each group it binds."""

    def __init__(self, module: nn.Module, plan: Plan, size: int) -> None:
        if size < 1:
            raise ElasticError(f"size({size}) counts the ranks of a tensor-parallel group: it must be at least 1")
        check_plan(module, plan, size)
        self.plan, self.size = dict(plan), size
        self.rank: int | None = None  # this process's rank in every group it binds, fixed by the first bind
        self._skeleton = _on_meta(module)
        self._initial: nn.Module | None = module  # the full weights, until the first bind cuts them
        self._device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._module: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []

    @property
    def module(self) -> nn.Module:
        """This generation's parallelized module: its planned parameters are DTensors, the others plain tensors."""
        if self._module is None:
            raise ElasticError("TensorParallelModel.module is built by bind(group); call bind before running or "
                               "building the optimizer")
        return self._module

    def bind(self, group: dist.ProcessGroup | None = None) -> None:
        """Build the module over `group` (the default group if None): every rank of it, in each generation's
        tensor-parallel group, at the same rank as before. The parameters keep their values and adopted
        optimizers their state."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != self.size:
            raise ElasticError(f"The tensor-parallel group has {size} ranks and the model is cut for "
                               f"size({self.size}): bind each replica's tensor-parallel group of exactly "
                               f"{self.size} ranks")
        if self.rank is not None and rank != self.rank:
            raise ElasticError(f"This process holds tensor-parallel rank {self.rank}'s slices but is rank {rank} of "
                               f"the new group: form each generation's tensor-parallel group with the same process "
                               f"at each rank (re-cutting would gather the whole model on every rank)")
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, self._device.type)
        # DTensor caches each op's sharding by its inputs' specs, and specs compare meshes by their ranks alone: a
        # decision cached in an earlier group would hand back that group's mesh, whose group name may now name
        # another group or none ("Could not resolve the process group registered under the name ...").
        _clear_sharding_prop_cache()
        module = copy.deepcopy(self._skeleton)
        # On the meta device nothing is scattered; _fill gives the weights.
        parallelize_module(module, mesh, self.plan, src_data_rank=None)
        first = self._initial is not None
        successors = _fill(module, self._initial if first else self._module, mesh, cut=first)
        for optimizer in self._optimizers:
            _repoint(optimizer, successors, mesh)
            _check_kernels(optimizer)
        if first:
            for param in self._initial.parameters():
                if successors[id(param)] is not param:
                    param.data = param.data.new_empty(0)  # its slices are in the new module now
            self._initial = None
        old = [self._module]
        self._module, self.rank = module, rank
        # The old module's DTensors hold the old group through their mesh; a gloo group's last reference
        # closes its sockets and joins its threads, which may wait on a dead peer: let it go on a thread.
        threading.Thread(target=old.clear, name="elastic-leave-tp").start()

    def adopt(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Carry `optimizer` (over this module's parameters, or before the first bind over the given model's)
        through later binds: it is returned as is, and each bind re-points its parameters and state to the new
        module."""
        holder = self._module if self._module is not None else self._initial
        mine = {id(p) for p in holder.parameters()}
        foreign = sum(id(p) not in mine for group in optimizer.param_groups for p in group["params"])
        if foreign:
            raise ElasticError(f"The optimizer steps {foreign} parameters that are not tp.module's: build it over "
                               f"tp.module.parameters() after bind(group) (or over the given model's before the first "
                               f"bind)")
        _check_kernels(optimizer)
        self._optimizers.append(optimizer)
        return optimizer


def _check_kernels(optimizer: torch.optim.Optimizer) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kernels = [kind for kind in ("foreach", "fused") if any(group.get(kind) for group in optimizer.param_groups)]
    if kernels and len({isinstance(p, DTensor) for p in params}) > 1:
        raise ElasticError(f"The optimizer runs torch's {kernels[0]} kernel, which takes plain tensors or DTensors "
                           f"but not both in one call, and its parameters are both (the planned ones are "
                           f"DTensors): build it with {kernels[0]}=False; the default, None, steps each tensor on "
                           f"its own when there are DTensors")


def check_plan(module: nn.Module, plan: Plan, size: int) -> None:
    """Refuse a plan the model cannot run: a key matching nothing, a module inside nn.MultiheadAttention, heads
    split across ranks, a style on a module it cannot cut, a cut into unequal slices."""
    targets = []
    for path, style in plan.items():
        found = resolve(module, path)
        if not found:
            raise ElasticError(f"Plan key {path!r} matches no submodule of {type(module).__name__}: name module paths "
                               f"as model.named_modules() does ('*' matches any one name)")
        targets += [(name, target, style) for name, target in found]
    for name, _, _ in targets:
        _refuse_inside_fused_attention(module, name)
    planned = {name for name, _, _ in targets}
    for name, attention in module.named_modules():
        projections = {f"{name}.{p}" if name else p for p in ("q_proj", "k_proj", "v_proj")}
        if isinstance(attention, SelfAttention) and planned & projections and attention.n_heads % size:
            raise ElasticError(f"SelfAttention {name!r} has n_heads({attention.n_heads}), which the tensor-parallel "
                               f"size({size}) does not divide, and each rank computes whole heads: use a size dividing "
                               f"{attention.n_heads}, or a head count that is a multiple of {size}")
    for name, target, style in targets:
        _check_cut(name, target, style, size)


def _check_cut(name: str, target: nn.Module, style: ParallelStyle, size: int) -> None:
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    kind = type(style).__name__
    if not isinstance(target, (nn.Linear, nn.Embedding)):
        raise ElasticError(f"{kind} cuts nn.Linear and nn.Embedding, and plan key {name!r} names a "
                           f"{type(target).__name__}: plan only the projections, and leave norms and activations "
                           f"out of the plan (they run whole on every rank)")
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(target, nn.Linear):
        width, what = (target.out_features, "output") if colwise else (target.in_features, "input")
    else:
        width, what = (target.embedding_dim, "embedding") if colwise else (target.num_embeddings, "vocabulary")
    if width % size:
        raise ElasticError(f"{kind} cuts {name!r} ({target}) into size({size}) slices of its {width} {what} features, "
                           f"and {size} does not divide {width}: every rank holds an equal slice, so use a size "
                           f"dividing {width}, or a width that {size} divides (e.g. {width + size - width % size})")


def _refuse_inside_fused_attention(module: nn.Module, name: str) -> None:
    parts = name.split(".")
    for depth in range(len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if isinstance(module.get_submodule(prefix), nn.MultiheadAttention):
            raise ElasticError(
                f"Plan key {name!r} is in nn.MultiheadAttention {prefix!r}, which tensor parallelism cannot cut: it "
                f"keeps q, k and v in one fused in_proj_weight (a parameter, not Linears a style cuts by heads), "
                f"and its forward reads its weights directly, so a style's hooks never run. Use "
                f"elastic.parallel.tensor_parallel.SelfAttention (separate q_proj, k_proj, v_proj) with "
                f"attention_plan(path); the demo's TinyLM does with ModelConfig(attention='split')")


def resolve(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """The submodules `path` names, matched one name at a time with fnmatch as parallelize_module matches them."""
    if not path:
        return [("", module)]
    token, _, rest = path.partition(".")
    found = []
    for name, child in module.named_children():
        if fnmatch(name, token):
            found += [(f"{name}.{sub}" if sub else name, target) for sub, target in resolve(child, rest)]
    return found


def _fill(module: nn.Module, source: nn.Module, mesh: DeviceMesh, cut: bool) -> dict[int, torch.Tensor]:
    """Give the meta `module` its weights from `source` (the same model, whole if `cut`, else parallelized on
    another mesh). Planned tensors become DTensors on `mesh`: slices of rank 0's whole tensors if `cut`, else the
    source's own local slices. Plain parameters and buffers are the source's own tensors (first broadcast from
    rank 0 if `cut`). Returns each source parameter's successor (itself if plain), by the source parameter's id."""
    group = mesh.get_group()

    def placed(old: torch.Tensor, meta: DTensor) -> DTensor:
        if cut:
            return distribute_tensor(old.detach(), mesh, meta.placements, src_data_rank=0)
        return _rewrap(old.detach(), mesh)

    def plain(old: torch.Tensor) -> torch.Tensor:
        if cut:
            dist.broadcast(old.detach(), group_src=0, group=group)
        return old

    sources = dict(source.named_parameters(remove_duplicate=False))
    made: dict[int, torch.Tensor] = {}  # by the source parameter's id: a tied one is filled (and sent) once
    with torch.no_grad():
        for name, meta in list(module.named_parameters(remove_duplicate=False)):
            old = sources[name]
            if id(old) not in made:
                made[id(old)] = (nn.Parameter(placed(old, meta), requires_grad=old.requires_grad)
                                 if isinstance(meta, DTensor) else plain(old))
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner).register_parameter(leaf, made[id(old)])
        buffers = dict(source.named_buffers(remove_duplicate=False))
        for name, meta in list(module.named_buffers(remove_duplicate=False)):
            owner, _, leaf = name.rpartition(".")
            # setattr keeps the buffer's persistence, which register_buffer would reset.
            setattr(module.get_submodule(owner), leaf,
                    placed(buffers[name], meta) if isinstance(meta, DTensor) else plain(buffers[name]))
    return made


def _rewrap(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The same local slice as a DTensor of the same placements on `mesh` (a plain tensor stays as it is)."""
    if not isinstance(tensor, DTensor):
        return tensor
    return DTensor.from_local(tensor.to_local(), mesh, tensor.placements, run_check=False, shape=tensor.shape,
                              stride=tensor.stride())


def _repoint(optimizer: torch.optim.Optimizer, successors: dict[int, torch.Tensor], mesh: DeviceMesh) -> None:
    """Make `optimizer` step the new parameters, with its state's DTensors on the new mesh (same local tensors)."""
    for group in optimizer.param_groups:
        renamed = [successors[id(p)] for p in group["params"]]
        for old, new in zip(group["params"], renamed):
            if new is not old and old in optimizer.state:
                optimizer.state[new] = {key: _rewrap(value, mesh) for key, value in optimizer.state.pop(old).items()}
        group["params"] = renamed


def _on_meta(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device, without copying its weights (tied parameters stay tied)."""
    memo: dict[int, nn.Module | torch.Tensor] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo)

