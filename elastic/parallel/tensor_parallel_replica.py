"""The prepared model of a tensor-parallel run: this worker's slices of its replica's model.

With `ScalingConfig(tensor_parallel=T)`, a replica is T workers that cut the model's planned
layers between them (`elastic.parallel.tensor_parallel`), and
`ctx.prepare_model(model, tensor_parallel_plan=plan)` returns a `TensorParallelReplica` (the
plan defaults to `model.tensor_parallel_plan()`, which the demo's split TinyLM has). The train
loop is a plain run's: every worker of a replica gets the replica's share of the global batch
in `step.micro_batches()`, and `mb.backward(loss_fn(model(x), y))`.

Each generation binds the model to the replica's tensor-parallel group (a new module over the
same local slices, see `TensorParallelModel.bind`); the optimizer, built over `model.parameters()`
before the first generation, is carried to each new module. Before the optimizer steps, each
worker sums its local gradients (slices and whole tensors alike) with the same tensor-parallel
rank of every other replica, over its data-parallel group.

What a heal or a grow syncs, and a checkpoint holds, is each worker's local slices
(`state_dict`), with the dimension each one is cut along, and the optimizer's state as local
slices too (`LocalSlices`): tensor-parallel rank j of a new replica receives the slices of rank j
of a live one.

`TensorParallelKind` is this run's prepared model as the worker's runtime sees it (a
`ReplicaModel`); a pipelined run's tensor-parallel stages share its random state and adopt its
optimizer alike (`share_random_state`, `adopt`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from elastic.checkpoint.checkpoint import WHOLE, join_parts
from elastic.comm.flat_state import reduce_in_place
from elastic.comm.state_sync import RunState, SyncResult, state_of
from elastic.errors import ElasticError
from elastic.parallel.prepared import DTENSOR, ComputeFrames, Generation, WorkerPlace
from elastic.parallel.replica_model import ReplicaModel
from elastic.parallel.tensor_parallel import Plan, TensorParallelModel


class TensorParallelReplica:
    """This worker's tensor-parallel slices of the model, rebound in each generation."""

    def __init__(self, model: nn.Module, plan: Plan, size: int) -> None:
        self.tp = TensorParallelModel(model, plan, size)
        self._given: nn.Module | None = model  # what the optimizer is built over, until the first bind
        self._training = model.training  # each bind builds a new module: the mode is carried over

    @property
    def module(self) -> nn.Module:
        """This generation's module (the given model until the first generation formed)."""
        return self._given if self._given is not None else self.tp.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._given is not None:
            raise ElasticError("the tensor-parallel model runs once the first generation formed: call it inside "
                               "`with step:` of ctx.steps()")
        return self.tp.module(*args, **kwargs)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def train(self, mode: bool = True) -> "TensorParallelReplica":
        self._training = mode
        self.module.train(mode)
        return self

    def eval(self) -> "TensorParallelReplica":
        return self.train(False)

    def bind(self, group: Any) -> None:
        self.tp.bind(group)
        self._given = None
        self.tp.module.train(self._training)

    def state_dict(self) -> dict[str, Any]:
        """This worker's local slices, and the dimension each is cut along (WHOLE if not cut)."""
        state = self.tp.module.state_dict()
        return {"tensors": {name: local(tensor) for name, tensor in state.items()},
                "dims": {name: cut_dim(tensor) for name, tensor in state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, tensor in self.tp.module.state_dict().items():
                local(tensor).copy_(state["tensors"][name])



class LocalSlices:
    """An optimizer's state as this worker's local slices: what a sync sends and a checkpoint holds.
    Loading puts each slice back as a DTensor like its parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        return {**state, "state": {index: {key: local(value) for key, value in values.items()}
                                   for index, values in state["state"].items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if not isinstance(param, DTensor) or param not in self.optimizer.state:
                    continue
                values = self.optimizer.state[param]
                for key, value in values.items():
                    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                            and value.shape == param.to_local().shape:
                        values[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                         shape=param.shape, stride=param.stride())


def local_gradients(module: nn.Module) -> list[torch.Tensor]:
    """Each trainable parameter's gradient as this worker holds it (a DTensor's local slice), zeros for one
    that got none this step: every replica's same worker sums the same buffer, and gloo kills a process
    whose collective differs in size (DDP adds zeros for an unused parameter too)."""
    grads = []
    for param in module.parameters():
        if param.requires_grad:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(local(param.grad))
    return grads


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def cut_dim(tensor: torch.Tensor) -> int:
    if isinstance(tensor, DTensor):
        for placement in tensor.placements:
            if isinstance(placement, Shard):
                return placement.dim
    return WHOLE


def share_random_state(group: dist.ProcessGroup, random: Any) -> None:
    """Every worker of a tensor-parallel replica computes the model's whole (unplanned) parts alike, so
    they draw the same random numbers (dropout, say): the replica's rank 0 gives them its streams."""
    box = [random.state_dict() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    random.load_state_dict(box[0])


def adopt(tensor: TensorParallelReplica, optimizer: torch.optim.Optimizer, state: RunState) -> None:
    """Carry `optimizer` to each generation's module, and sync its state as local slices."""
    tensor.tp.adopt(optimizer)
    state.adopt_optimizer(LocalSlices(optimizer))


def plan_of(model: nn.Module, plan: Plan | None, size: int) -> Plan:
    """The plan given to prepare_model, or the model's own `tensor_parallel_plan()`."""
    if plan is not None:
        return plan
    if not callable(getattr(model, "tensor_parallel_plan", None)):
        raise ElasticError(
            f"with tensor_parallel({size}) the model's layers are cut by a plan: call "
            "ctx.prepare_model(model, tensor_parallel_plan=...), e.g. elastic.parallel.tensor_parallel.mlp_plan("
            "'0', '2') for a Sequential's Linear pair, or give the model a tensor_parallel_plan() method")
    return model.tensor_parallel_plan()


class TensorParallelKind(ReplicaModel):
    """A tensor-parallel run's prepared model: this worker's slices, whose replicas average their gradients."""

    compute_frames = ComputeFrames((DTENSOR,))

    def __init__(self, place: WorkerPlace, model: nn.Module, state: RunState, plan: Plan | None) -> None:
        super().__init__(place.shape, place.slot, place.device)
        plan = plan_of(model, plan, place.shape.tensor_parallel)
        model.to(place.device)
        self.returned = TensorParallelReplica(model, plan, place.shape.tensor_parallel)
        state.model = self.returned

    def bind(self, generation: Generation) -> None:
        super().bind(generation)
        self.returned.bind(self.mesh_groups["tp"])  # before any state moves: the state is its local slices

    def synced(self, sync: SyncResult, step: int, random: Any) -> SyncResult:
        sync = super().synced(sync, step, random)
        share_random_state(self.mesh_groups["tp"], random)
        return sync

    def after_last_backward(self, step: Any) -> Callable[[], None]:
        return lambda: self.average_step(step)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, state: RunState,
                          current_step: Callable[[], Any]) -> None:
        adopt(self.returned, optimizer, state)
        # The last micro-batch's mb.backward averages; this averages a step whose loop stopped
        # before it, or a replica that got no micro-batch.
        optimizer.register_step_pre_hook(lambda *_: self.average_step(current_step()))

    def average_step(self, step: Any) -> None:
        """Once a step's last micro-batch is backpropagated, as DDP averages in its backward (so
        clipping and logging see the global batch's gradient): each local gradient averaged with the
        same tensor-parallel rank of every replica (the micro-batches' weights make the mean the global
        batch's). Once per step."""
        if step is None or step.averaged:
            return
        step.averaged = True
        reduce_in_place(local_gradients(self.returned.module), self.average, divide=self.replicas)
        self.agree()  # as PipelinedReplica.step: no rank steps while another's average failed

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        return join_parts(self.gathered(state_of(self.returned), "tp"))
