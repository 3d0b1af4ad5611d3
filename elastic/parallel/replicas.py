"""Replicas, the elastic unit of 3D-parallel training: their layout over a generation's ranks,
the groups each rank trains in, and which ranks stay when a member dies.

A replica is `pipeline_stages x tensor_parallel` workers that together hold one copy of the
model. Ranks are laid out replica-major, rank = replica·S + stage·T + t with T the tensor-parallel
size and S = stages·T, so one `DeviceMesh` of shape (replicas, stages, T) with the dims
("dp", "pp", "tp") holds every group of a generation: a replica's pipeline group (dim "pp"), a
stage's tensor-parallel group (dim "tp"), and each position's data-parallel group across the
replicas (dim "dp"), over which that position's gradients are averaged and, when a replica
joins, its state is sent from the same position of a live replica (`sync_state` over the dp
group). The mesh is built afresh in each generation's group.

A death anywhere takes its whole replica out (`whole_replicas`): the replica cannot run without
one of its stages, so its other members leave too and wait to form a new replica with fresh
capacity; the remaining replicas keep their order and heal in place at one replica fewer. The
global batch is split across replicas exactly as it is split across ranks without parallelism,
and each replica cuts its share into pipeline micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastic.config import ScalingConfig
from elastic.errors import ElasticError

MESH_DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Position:
    """Where a rank sits: its replica, its pipeline stage, and its tensor-parallel index."""

    replica: int
    stage: int
    tensor: int


@dataclass(frozen=True)
class ReplicaShape:
    """`pipeline_stages x tensor_parallel` workers per replica."""

    pipeline_stages: int = 1
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.pipeline_stages < 1 or self.tensor_parallel < 1:
            raise ElasticError(f"pipeline_stages({self.pipeline_stages}) and tensor_parallel({self.tensor_parallel}) "
                               "count workers per replica: each must be 1 or more")

    @classmethod
    def of(cls, scaling: ScalingConfig) -> ReplicaShape:
        """The replica shape of a run's `ScalingConfig`."""
        return cls(scaling.pipeline_stages, scaling.tensor_parallel)

    @property
    def size(self) -> int:
        """Workers per replica."""
        return self.pipeline_stages * self.tensor_parallel

    def replicas(self, world_size: int) -> int:
        if world_size % self.size:
            raise ElasticError(f"world_size({world_size}) is not a whole number of replicas of {self.size} workers "
                               f"(pipeline_stages={self.pipeline_stages} x tensor_parallel={self.tensor_parallel}); "
                               "a generation forms only of whole replicas")
        return world_size // self.size

    def position(self, rank: int) -> Position:
        replica, within = divmod(rank, self.size)
        stage, tensor = divmod(within, self.tensor_parallel)
        return Position(replica, stage, tensor)

    def mesh(self, world_size: int, device_type: str = "cpu") -> DeviceMesh:
        """The generation's mesh over the current default group, a collective of every rank: dims "dp", then "pp"
        with pipeline stages and "tp" with tensor parallelism. A dim of size 1 is left out: each dim's groups are
        formed by collectives of every rank, and one of size 1 would form a group per rank in every heal and grow."""
        sizes = dict(zip(MESH_DIMS, (self.replicas(world_size), self.pipeline_stages, self.tensor_parallel)))
        dims = [dim for dim in MESH_DIMS if dim == "dp" or sizes[dim] > 1]
        return init_device_mesh(device_type, tuple(sizes[dim] for dim in dims), mesh_dim_names=tuple(dims))

    def whole_replicas(self, alive: Sequence[bool]) -> tuple[list[int], list[int]]:
        """(the ranks that stay, in order: every member of each replica whose members all live;
        the live ranks released because a member of their replica died)."""
        replicas = self.replicas(len(alive))
        staying, released = [], []
        for replica in range(replicas):
            members = range(replica * self.size, (replica + 1) * self.size)
            whole = all(alive[rank] for rank in members)
            (staying if whole else released).extend(rank for rank in members if alive[rank])
        return staying, released


class ReplicaCoordinates:
    """Where a worker sits in its replica for its whole life, as properties of an object that holds the
    replica's `shape` and the worker's `slot` in it: the train loop reads them on its `TrainContext`."""

    shape: ReplicaShape
    slot: int

    pipeline_stage: int = property(lambda self: self.shape.position(self.slot).stage,
                                   doc="The pipeline stage this worker holds (0 without pipeline stages).")
    tensor_parallel_rank: int = property(lambda self: self.shape.position(self.slot).tensor, doc="This worker's "
                                         "rank in its replica's tensor-parallel group (0 without tensor parallelism).")
    pipelined: bool = property(lambda self: self.shape.pipeline_stages > 1)
    in_replicas: bool = property(lambda self: self.shape.size > 1, doc="Replicas of several workers are the run's "
                                 "data-parallel peers (pipeline stages or tensor parallelism).")
