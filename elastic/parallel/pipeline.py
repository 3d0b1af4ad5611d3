"""Pipeline parallelism over the stages of one replica, on torch.distributed.pipelining.

    pipe = PipelinedModel(model, stages=2, loss_fn=nn.functional.mse_loss, microbatches=4, schedule="1f1b")
    pipe.bind(stage_group)              # every stage, in each generation's stage group
    optimizer = torch.optim.AdamW(pipe.module.parameters(), lr=1e-3)
    loss = pipe.step(x, y)              # the batch's mean loss on the last stage, None on the others
    optimizer.step()

The model, an nn.Sequential or a list of modules, is cut into consecutive parts: evenly by layer
count (the first parts take one layer more where the count does not divide), or where the user
says (`split_points`: the index of the layer each part after the first begins with). GPipe and
1F1B run one part per stage. Interleaved1F1B runs two per stage (`VIRTUAL_STAGES`), placed as
torch places them, part i on stage i mod stages: with 2 stages, stage 0 holds parts 0 and 2 and
stage 1 holds parts 1 and 3, so each stage works on a micro-batch twice in its forward.

The gradient. Each micro-batch's loss is `loss_fn` on its slice of the batch and must be the
mean over that slice (torch's losses reduce so by default). The schedule backpropagates each of
the m losses as it is and then divides every gradient of the stage by m (`scale_grads=True`):
the gradient of the mean of m micro-batch means, which is the gradient of the batch's mean loss
because the micro-batches are equal (a batch that m does not divide is refused). A replica thus
holds the gradient one process would compute on its whole batch, and data-parallel replicas
average it as elastic's DDP averages ranks' gradients. The division applies to all of `.grad`,
so `step()` sets the gradients to None first: one left from before would be divided as well.

Binding. A PipelineStage and its schedule hold their process group, so each generation's stage
group needs new ones: `bind` builds them over the parts this process holds, which stay the same
modules, so the parameters and an optimizer over them carry across. Torch puts stage i on rank i
of the group; the first bind keeps the parts of this process's rank and drops the others (drop
your own reference to the whole model too, for their memory to go). A later bind at another rank
is refused: that stage's parameters live in another process. The first step after each bind also
runs torch's shape inference, one extra forward of the first micro-batch and a backward to the
inputs only (it leaves no gradient in the parameters), with messages to the neighbouring stages.

Limits: one tensor flows into and out of each part, as in nn.Sequential; every step of a binding
has the same batch shape, since the stages size their receive buffers at its first step; the
stage group has exactly `stages` ranks. Stages exchange tensors point to point (isend/irecv),
which gloo does on CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining import schedules

from elastic.comm.generation import wait_p2p
from elastic.errors import ElasticError

# torch's schedules wait on each batch of sends and receives with a plain `wait()`, which on gloo
# neither lasts a step's compute nor ends with the generation's abort (`wait_p2p`). They look the
# function up at each call.
schedules._wait_batch_p2p = wait_p2p

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2}  # parts each stage runs


def even_split_points(layers: int, parts: int) -> list[int]:
    """Where `layers` layers are cut into `parts` parts whose sizes differ by at most one, the first ones larger."""
    size, extra = divmod(layers, parts)
    points, start = [], 0
    for part in range(parts - 1):
        start += size + (part < extra)
        points.append(start)
    return points


class PipelinedModel:
    """A model cut into pipeline parts, the parts of this process's stage, and the schedule that trains them."""

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module], stages: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, microbatches: int,
                 schedule: str = "1f1b", split_points: Sequence[int] | None = None) -> None:
        named = _named_layers(layers)
        self.schedule = _schedule_name(schedule)
        self.stages, self.microbatches, self.loss_fn = stages, microbatches, loss_fn
        self.parts = stages * VIRTUAL_STAGES[self.schedule]
        _check_counts(self.schedule, stages, microbatches, self.parts, len(named))
        if split_points is None:
            points = even_split_points(len(named), self.parts)
        else:
            points = _checked_split_points(list(split_points), len(named), self.parts, self.schedule, stages)
        bounds = [0, *points, len(named)]
        self.spans: list[tuple[int, int]] = list(zip(bounds, bounds[1:]))  # each part's layers, [start, stop)
        self.stage_rank: int | None = None  # fixed by the first bind
        self.pipeline_stages: list[PipelineStage] = []  # torch's stages of the current binding
        self._layers: list[tuple[str, nn.Module]] | None = named  # every layer, until the first bind
        self._parts: dict[int, nn.Sequential] = {}
        self._module: nn.Module | None = None
        self._schedule = None
        self._shapes: dict[str, torch.Size] = {}

    @property
    def module(self) -> nn.Module:
        """This stage's layers, named as in the whole model: its state_dict is the whole one's share of this stage."""
        if self._module is None:
            raise ElasticError("PipelinedModel.module is known once bind(group) placed this process on a stage; "
                               "call bind before building the optimizer")
        return self._module

    @property
    def is_first(self) -> bool:
        return self.stage_rank == 0

    @property
    def is_last(self) -> bool:
        return self.stage_rank == self.stages - 1

    def bind(self, group: dist.ProcessGroup | None = None) -> None:
        """Build this stage's PipelineStages and the schedule over `group` (the default group if None): every stage,
        in each generation's stage group. The parameters stay those of the previous binding."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != self.stages:
            raise ElasticError(f"The stage group has {size} ranks and the model is cut for stages({self.stages}): "
                               f"bind each replica's group of exactly {self.stages} ranks, one per stage")
        if self.stage_rank is None:
            self.hold(rank)
        elif rank != self.stage_rank:
            raise ElasticError(f"This process holds stage {self.stage_rank}'s parameters but is rank {rank} of the new "
                               f"stage group, and torch runs stage i on rank i: form each generation's stage group "
                               f"with the process of stage i at rank i")
        device = next((p.device for p in self._module.parameters()), torch.device("cpu"))
        self.pipeline_stages = [PipelineStage(self._parts[index], index, self.parts, device, group=group)
                                for index in sorted(self._parts)]
        held = self.pipeline_stages if VIRTUAL_STAGES[self.schedule] > 1 else self.pipeline_stages[0]
        # scale_grads divides by m after the last backward: the mean over micro-batches of their mean losses.
        self._schedule = SCHEDULES[self.schedule](held, n_microbatches=self.microbatches, loss_fn=self.loss_fn,
                                                  scale_grads=True)
        self._shapes = {}

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor | None:
        """One forward and backward of the batch through every stage: the parameters' .grad is replaced by the
        gradient of the batch's mean loss. The first stage needs `inputs`, the last `targets`; pass both on every
        stage and each checks them, so a bad batch raises on every stage instead of leaving the others waiting.
        Returns the mean loss (detached) on the last stage, None on the others."""
        if self._schedule is None:
            raise ElasticError("PipelinedModel.step() before bind(group): bind every stage to its stage group first")
        if self.is_first and inputs is None:
            raise ElasticError("The first stage feeds the pipeline: pass the batch's inputs to step() on stage 0")
        if self.is_last and targets is None:
            raise ElasticError(f"The last stage computes the loss: pass the batch's targets to step() on stage "
                               f"{self.stages - 1}")
        for name, batch in (("inputs", inputs), ("targets", targets)):
            if batch is not None:
                self._check_batch(name, batch)
        for param in self._module.parameters():
            param.grad = None
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        self._schedule.step(*((inputs,) if self.is_first else ()), target=targets if self.is_last else None,
                            losses=losses, return_outputs=False)
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    def unbind(self) -> list[Any]:
        """Drop the binding's stages and schedule, which hold its process group, and return them: a
        group's last reference decides the thread its destructor runs on (see elastic.comm.group.leave_group)."""
        held = [self.pipeline_stages, self._schedule]
        self.pipeline_stages, self._schedule, self._shapes = [], None, {}
        return held

    def hold(self, rank: int) -> None:
        """Keep the parts stage `rank` runs, and forget the other stages' layers: the first bind does this,
        and a process that knows its stage before any group forms (an elastic run's worker) may do it sooner."""
        if self.stage_rank is not None:
            if rank != self.stage_rank:
                raise ElasticError(f"This process already holds stage {self.stage_rank}'s parameters; it cannot hold "
                                   f"stage {rank}'s")
            return
        self._parts = {index: nn.Sequential(OrderedDict(self._layers[start:stop]))
                       for index, (start, stop) in enumerate(self.spans) if index % self.stages == rank}
        self._module = nn.Module()
        for index in sorted(self._parts):
            for name, layer in self._parts[index].named_children():
                self._module.add_module(name, layer)
        self._layers = None
        self.stage_rank = rank

    def replace_module(self, module: nn.Module) -> None:
        """Run `module`'s layers, named as this stage's, in place of the ones it holds: a tensor-parallel stage's
        module is rebuilt at every bind (elastic.parallel.tensor_parallel). Call `bind` after."""
        self._parts = {index: nn.Sequential(OrderedDict((name, getattr(module, name)) for name, _ in
                                                        part.named_children()))
                       for index, part in self._parts.items()}
        self._module = module

    def _check_batch(self, name: str, batch: torch.Tensor) -> None:
        rows = batch.shape[0] if batch.dim() else 0
        if rows == 0 or rows % self.microbatches:
            fitting = max(self.microbatches, rows - rows % self.microbatches)
            raise ElasticError(f"A batch of {rows} {name} does not cut into microbatches({self.microbatches}) equal "
                               f"micro-batches, and unequal ones would weight samples unequally in the mean loss: "
                               f"give a batch whose first dimension is a multiple of {self.microbatches}, e.g. "
                               f"{fitting}")
        expected = self._shapes.setdefault(name, batch.shape)
        if batch.shape != expected:
            raise ElasticError(f"The {name} have shape {tuple(batch.shape)}, and the first step since bind() had "
                               f"{tuple(expected)}; the stages sized their buffers then: call bind(group) on every "
                               f"stage before stepping batches of another shape")


def _named_layers(layers: nn.Sequential | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    if isinstance(layers, nn.Sequential):
        return list(layers.named_children())
    if isinstance(layers, (list, tuple)) and all(isinstance(layer, nn.Module) for layer in layers):
        return [(str(index), layer) for index, layer in enumerate(layers)]
    raise ElasticError(f"PipelinedModel cuts an nn.Sequential or a list of modules, got {type(layers).__name__}: "
                       f"write the model as nn.Sequential(...) of the layers in the order they run")


def _schedule_name(schedule: str) -> str:
    name = schedule.lower()
    if name not in SCHEDULES:
        raise ElasticError(f"Unknown pipeline schedule {schedule!r}: choose one of {', '.join(map(repr, SCHEDULES))}")
    return name


def _check_counts(schedule: str, stages: int, microbatches: int, parts: int, layers: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ElasticError(f"stages({stages}) and microbatches({microbatches}) must each be at least 1")
    if parts > layers:
        per_stage = f" x {VIRTUAL_STAGES[schedule]} parts per stage of {schedule!r}" if parts != stages else ""
        raise ElasticError(f"{parts} pipeline parts (stages({stages}){per_stage}) need at least {parts} layers and "
                           f"the model has {layers}: use at most {layers // VIRTUAL_STAGES[schedule]} stages, or cut "
                           f"the model into more layers")
    if schedule == "1f1b" and microbatches < stages:
        raise ElasticError(f"Schedule '1f1b' needs at least one micro-batch per stage: microbatches({microbatches}) < "
                           f"stages({stages}); use microbatches >= {stages} (more also shrink the bubble, "
                           f"(p-1)/(m+p-1))")
    rounds = max(1, microbatches // stages)
    if schedule == "interleaved1f1b" and microbatches % rounds:
        raise ElasticError(f"Schedule 'interleaved1f1b' runs the micro-batches in {rounds} rounds of "
                           f"{microbatches // rounds}, and microbatches({microbatches}) is not a multiple of "
                           f"{rounds}: use a multiple of stages({stages}), e.g. {rounds * stages}")


def _checked_split_points(points: list[int], layers: int, parts: int, schedule: str, stages: int) -> list[int]:
    if len(points) != parts - 1:
        raise ElasticError(f"split_points {points} cut the model into {len(points) + 1} parts, and {schedule!r} "
                           f"with stages({stages}) runs {parts}: give {parts - 1} split points")
    if any(not 0 < point < layers for point in points) or any(a >= b for a, b in zip(points, points[1:])):
        raise ElasticError(f"split_points {points} must increase strictly within 1..{layers - 1}: each is the index "
                           f"of the layer a part begins with, and the model has {layers} layers")
    return points
