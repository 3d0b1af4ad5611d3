"""A run of replicas as the worker's runtime sees its prepared model: what every kind whose replica
is several workers (pipeline stages, tensor parallelism, or both) does alike in a generation.

`ReplicaModel` is a `PreparedModel` (`elastic.parallel.prepared`). Its groups come
from the generation's mesh (`ReplicaShape.mesh`); its state syncs over its data-parallel group,
the same place of every replica, and each replica averages its own gradients over that group.
On its own it is the kind of a run of replicas before `prepare_model`, holding no model;
`PipelinedKind` and `TensorParallelKind` add the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from elastic.checkpoint.checkpoint import Part
from elastic.comm.group import GenerationSpec
from elastic.comm.state_sync import SyncResult
from elastic.errors import ElasticError, StateLostError
from elastic.parallel.parts import part_name
from elastic.parallel.prepared import Generation, PreparedModel
from elastic.parallel.replicas import Position, ReplicaShape


class ReplicaModel(PreparedModel):
    """This worker's place in a replica of `shape` workers, and its groups in the current generation."""

    # A replica's subgroups must be abortable on gloo at any world size: a death in one replica
    # leaves the others blocked in the data-parallel group's collectives.
    abortable = True

    def __init__(self, shape: ReplicaShape, slot: int, device: torch.device) -> None:
        self.shape = shape
        self.slot = slot  # this worker's place in its replica, for its whole life
        self.device = device
        self.part_name = part_name(shape, slot)
        self.position: Position | None = None  # its replica and stage in the current generation
        self.replicas = 0  # in the current generation
        self.data_group: dist.ProcessGroup | None = None  # the same place of every replica, this generation
        self.mesh_groups: dict[str, dist.ProcessGroup] = {}  # this generation's "pp" and "tp", where present
        self.average: Callable[[torch.Tensor], None] | None = None
        self.agree: Callable[[], None] | None = None

    def connect(self, spec: GenerationSpec) -> dist.ProcessGroup:
        """This generation's groups of this worker, by the replicas' mesh dims: "dp" (the same place in every
        replica), and "pp" (its replica's pipeline) and "tp" (its stage's tensor-parallel group) where present."""
        self.position = self.shape.position(spec.rank)
        if (self.position.stage, self.position.tensor) != divmod(self.slot, self.shape.tensor_parallel):
            raise ElasticError(f"rank {spec.rank} of generation {spec.generation} is at {self.position} of its "
                               f"replica, but this worker holds slot {self.slot}: the controller must keep each "
                               "replica's workers in order; this is a bug in elastic")
        mesh = self.shape.mesh(spec.world_size, self.device.type)
        groups = {dim: mesh.get_group(dim) for dim in mesh.mesh_dim_names}
        self.replicas = self.shape.replicas(spec.world_size)
        self.data_group = groups.pop("dp")
        self.mesh_groups = groups
        return self.data_group

    def bind(self, generation: Generation) -> None:
        self.average, self.agree = generation.average, generation.agree

    def synced(self, sync: SyncResult, step: int, random: Any) -> SyncResult:
        """Every worker of a run of replicas resumes at the same step; the source, a rank of the data-parallel
        group, as a global rank."""
        _check_stages_agree(step, self.device)
        return dataclasses.replace(sync, source_rank=dist.get_global_rank(self.data_group, sync.source_rank))

    def unbind(self) -> list[Any]:
        held = [self.data_group]
        self.data_group = None
        self.mesh_groups = {}
        self.average = self.agree = None
        return held

    def checkpoint_part(self, replica: int, replicas: int) -> Part:
        return Part(self.part_name, replica, replicas)

    def gathered(self, part: Any, dim: str) -> list[Any]:
        """`part` of every worker of this worker's `dim` group ("pp" or "tp"), in order, on the CPU."""
        group = self.mesh_groups[dim]
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, _on_cpu(part), group=group)
        return parts


def _on_cpu(state: Any) -> Any:
    """`state` (nested containers of tensors) with every tensor copied to the CPU, to send by pickle."""
    return tree_map(lambda leaf: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else leaf, state)


def _check_stages_agree(step: int, device: torch.device) -> None:
    """Every worker of a run of replicas must resume at the same step: each synced with its own
    data-parallel group only. The end-of-step agreement (`GradientAllReduce.agree`) keeps any
    stage (or tensor-parallel rank) from stepping ahead of another; should one still be found
    ahead, no live process can undo it, and the run restarts from its latest checkpoint."""
    steps = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(steps, torch.tensor([step], dtype=torch.int64, device=device))
    found = sorted({int(s.item()) for s in steps})
    if len(found) > 1:
        raise StateLostError(f"the replicas' workers hold the state of different steps ({found}): a death ended a "
                             "step on some of them and not on others")
