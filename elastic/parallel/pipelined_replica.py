"""The prepared model of a pipelined run: this worker's pipeline stage of its replica.

With `ScalingConfig(pipeline_stages=S)`, `ctx.prepare_model(nn.Sequential(...), loss_fn=...)`
returns a `PipelinedReplica`. The worker's stage is fixed when it starts (the i-th worker of a
replica holds stage i for its whole life), so the other stages' layers are dropped at once and
the optimizer is built over this stage's parameters:

    model = ctx.prepare_model(nn.Sequential(...), loss_fn=nn.functional.mse_loss)
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in ctx.steps(dataset):
        with step:
            batch = step.batch()             # this replica's share of the global batch: (inputs, targets)
            loss = model.step(batch)         # the replica's mean loss on the last stage, None on the others
            optimizer.step()
            optimizer.zero_grad()

`step(batch)` runs the replica's share through the pipeline schedule, which cuts it into
`Strategy(pipeline_microbatches)` micro-batches and leaves each stage's gradient of the share's
mean loss; then each stage's gradients are averaged across the replicas, over its data-parallel
group (the same stage of every replica), each weighted by its share of the step's samples. That
is the gradient of the global batch's mean loss, as one process would compute it: the same
math at any number of replicas.

Every generation binds the stage anew (`bind`): torch's pipeline stage and schedule hold their
process group, and each generation's mesh has new ones.

`PipelinedKind` is this run's prepared model as the worker's runtime sees it (a `ReplicaModel`):
it cuts the replica's share of a step into one `ReplicaBatch` and binds the stage to each
generation, and, with tensor-parallel stages (3D), their slices first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic.checkpoint.checkpoint import join_parts
from elastic.comm.flat_state import reduce_in_place
from elastic.comm.state_sync import RunState, SyncResult, state_of
from elastic.data.loader import to_device
from elastic.errors import ElasticError, UnweightedBackwardError
from elastic.parallel.pipeline import PipelinedModel
from elastic.parallel.prepared import DTENSOR, ComputeFrames, Generation, WorkerPlace
from elastic.parallel.replica_model import ReplicaModel
from elastic.parallel.tensor_parallel import Plan, check_plan, resolve
from elastic.parallel.tensor_parallel_replica import (
    TensorParallelReplica, adopt, local_gradients, plan_of, share_random_state,
)


@dataclass
class ReplicaBatch:
    """A replica's share of one step: the collated `data` (inputs, targets), its sample `indices`,
    and its `weight`, the share's part of the step's samples."""

    data: Any
    indices: torch.Tensor
    weight: float
    on_sync: Callable[[], None]  # called once the share's backward is done, before the gradients travel


class PipelinedReplica:
    """One stage of a replica's pipelined model, whose gradients average over the replicas."""

    def __init__(self, layers: nn.Sequential, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                 stages: int, stage: int, microbatches: int, schedule: str, tensor_parallel: int = 1,
                 plan: Plan | None = None, split_points: Sequence[int] | None = None) -> None:
        self.pipe = PipelinedModel(layers, stages, loss_fn, microbatches=microbatches, schedule=schedule,
                                   split_points=split_points)
        if tensor_parallel > 1:
            # On the whole model: a key that names no layer of any stage is refused, not dropped.
            check_plan(layers if isinstance(layers, nn.Module) else nn.Sequential(*layers), plan or {}, tensor_parallel)
        self.pipe.hold(stage)
        # With tensor parallelism the stage's layers are cut across its tensor-parallel group: each
        # generation binds that first (the state is its local slices), then the stage's pipeline.
        self.tensor = (TensorParallelReplica(self.pipe.module, stage_plan(plan or {}, self.pipe.module),
                                             tensor_parallel) if tensor_parallel > 1 else None)
        self._average: Callable[[torch.Tensor], None] | None = None
        self._agree: Callable[[], None] | None = None

    @property
    def module(self) -> nn.Module:
        """This stage's layers, under the whole model's names (this generation's, when tensor parallel)."""
        return self.tensor.module if self.tensor is not None else self.pipe.module

    def train(self, mode: bool = True) -> "PipelinedReplica":
        (self.tensor or self.module).train(mode)
        return self

    def eval(self) -> "PipelinedReplica":
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        return self.tensor.state_dict() if self.tensor is not None else self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tensor is not None:
            self.tensor.load_state_dict(state)
        else:
            self.module.load_state_dict(state)

    def bind(self, pipeline_group: dist.ProcessGroup, average: Callable[[torch.Tensor], None],
             agree: Callable[[], None]) -> None:
        """Join this generation: the replica's stages over `pipeline_group`; `average`, which sums
        a flat buffer of gradients across the replicas in place (a collective of the stage's
        data-parallel group); and `agree`, which returns once every stage of every replica holds
        its averaged gradients, and fails on every survivor alike if one does not (see `step`). A tensor-parallel stage's
        `tensor` is bound to its group before."""
        if self.tensor is not None:
            self.pipe.replace_module(self.tensor.tp.module)
        self.pipe.bind(pipeline_group)
        self._average, self._agree = average, agree

    def unbind(self) -> list[Any]:
        """Leave the generation: what held its process groups, for the caller to let go of."""
        held = self.pipe.unbind()
        self._average = self._agree = None
        return held

    def step(self, batch: ReplicaBatch) -> torch.Tensor | None:
        """Forward and backward of the replica's share through the pipeline, then the gradients
        averaged across the replicas: each parameter's .grad is the global batch's."""
        if self._average is None:
            raise ElasticError("model.step(batch) runs inside `with step:` of ctx.steps(), once a generation formed")
        inputs, targets = _inputs_and_targets(batch.data)
        loss = self.pipe.step(inputs, targets)
        batch.on_sync()
        reduce_in_place(local_gradients(self.module), self._average, scale=batch.weight)
        # The stages average over different groups, so a death can fail one stage's average while
        # another's completes; a stage that then stepped would be a step ahead of its replica,
        # which no sync can undo. So no rank steps until the store says that every rank averaged.
        self._agree()
        return loss


class PipelinedKind(ReplicaModel):
    """A pipelined run's prepared model: this worker's stage (tensor-parallel slices of it in 3D)."""

    needs_full_steps = True
    # torch's schedules run the stage's layers (DTensor's, in 3D); they wait on a batch of sends and
    # receives in `elastic.comm.generation.wait_p2p`, which the hang probe knows as a wait on peers.
    compute_frames = ComputeFrames(("torch.distributed.pipelining", DTENSOR))

    def __init__(self, place: WorkerPlace, model: nn.Sequential | None, state: RunState,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, plan: Plan | None,
                 split_points: Sequence[int] | None) -> None:
        super().__init__(place.shape, place.slot, place.device)
        shape, strategy = place.shape, place.strategy
        self.microbatches = strategy.pipeline_microbatches
        self.tensor: TensorParallelReplica | None = None
        if model is None:
            return  # before prepare_model: the run's batches are cut alike
        if loss_fn is None:
            raise ElasticError(f"with pipeline_stages({shape.pipeline_stages}) the last stage computes the loss: "
                               "call ctx.prepare_model(model, loss_fn=...), e.g. loss_fn=nn.functional.mse_loss, "
                               "a function of (outputs, targets) returning their mean loss")
        if shape.tensor_parallel > 1:
            plan = plan_of(model, plan, shape.tensor_parallel)
        self.returned = PipelinedReplica(model, loss_fn, stages=shape.pipeline_stages,
                                         stage=place.slot // shape.tensor_parallel, microbatches=self.microbatches,
                                         schedule=strategy.pipeline_schedule, tensor_parallel=shape.tensor_parallel,
                                         plan=plan, split_points=split_points)
        self.returned.module.to(place.device)  # this stage only: the others' layers are dropped
        self.tensor = self.returned.tensor  # its slices, when its stage is tensor parallel
        state.model = self.returned

    def bind(self, generation: Generation) -> None:
        super().bind(generation)
        if self.tensor is not None:
            self.tensor.bind(self.mesh_groups["tp"])  # before any state moves: the state is its local slices

    def synced(self, sync: SyncResult, step: int, random: Any) -> SyncResult:
        sync = super().synced(sync, step, random)
        if self.tensor is not None:
            share_random_state(self.mesh_groups["tp"], random)
        return sync

    def start(self, generation: Generation) -> bool:
        if self.returned is not None:
            self.returned.bind(self.mesh_groups["pp"], self.average, self.agree)
        return False

    def unbind(self) -> list[Any]:
        return [*super().unbind(), *(self.returned.unbind() if self.returned is not None else [])]

    def check_micro_batches(self) -> None:
        raise ElasticError("in a pipelined run the stages take the replica's share as one batch, which the "
                           "schedule cuts into micro-batches: use `batch = step.batch()` and `model.step(batch)`")

    def batch(self, step: Any, load: Callable[[], list], on_sync: Callable[[], None]) -> ReplicaBatch:
        """The replica's share of `step` as one batch, which every stage of the replica reads alike."""
        loaded = [micro for micro in load() if micro.samples]
        samples = sum(micro.samples for micro in loaded)
        if samples == 0 or samples % self.microbatches:
            raise ElasticError(
                f"step {step.index} gives replica {self.position.replica} of {self.replicas} {samples} samples, "
                f"which do not cut into pipeline_microbatches({self.microbatches}) equal micro-batches (the epoch's "
                "last step is short when the dataset's size is not a multiple of global_batch_size): set "
                "DataConfig(drop_last=True), or give a dataset of a multiple of global_batch_size samples")
        return ReplicaBatch(
            data=to_device(concatenated([micro.data for micro in loaded]), self.device),
            indices=torch.cat([micro.indices for micro in loaded]),
            weight=samples / step.samples,  # the replicas' weighted gradients sum to the step's mean
            on_sync=on_sync)

    def unweighted_error(self, step: Any) -> ElasticError:
        return UnweightedBackwardError(f"step {step.index}: the optimizer steps before model.step(batch) ran the "
                                       "replica's batch: call loss = model.step(step.batch()) first")

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, state: RunState,
                          current_step: Callable[[], Any]) -> None:
        if self.tensor is not None:
            adopt(self.tensor, optimizer, state)  # a stage averages its gradients in model.step

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's part (its slices joined first, in 3D), then every stage's joined under their layers' names."""
        part = state_of(self.returned)
        if self.tensor is not None:
            part = join_parts(self.gathered(part, "tp"))
        return {name: tensor for stage in self.gathered(part, "pp") for name, tensor in stage.items()}


def stage_plan(plan: Plan, stage: nn.Module) -> dict[str, Any]:
    """The keys of a whole model's tensor-parallel plan that name modules of this stage (its layers keep
    the whole model's names)."""
    return {path: style for path, style in plan.items() if resolve(stage, path)}


def _inputs_and_targets(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return data[0], data[1]
    raise ElasticError(f"a pipelined run's dataset must give (inputs, targets) pairs of tensors, which stage 0 and the "
                       f"last stage take; a batch of them collated to {type(data).__name__} is not one")


def concatenated(parts: list[Any]) -> Any:
    """Collated micro-batches (tensors, or tuples/lists/dicts of them) joined into one batch."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, (tuple, list)):
        return type(first)(concatenated(list(items)) for items in zip(*parts))
    if isinstance(first, dict):
        return {key: concatenated([part[key] for part in parts]) for key in first}
    raise ElasticError(f"a pipelined run joins its share's micro-batches into one batch, and cannot join "
                       f"{type(first).__name__}; give a dataset whose samples collate to tensors")

