"""The one interface of every kind of prepared model (`PreparedModel`), and what a kind is given.

`ctx.prepare_model` hands the user's model to the factory (`elastic.worker.model_kinds`), which
picks its kind once from the run's shape and strategy; from then on the worker's runtime (its
context, membership and micro-batching) talks to a `PreparedModel` and never asks which kind it
is. The kinds:

- `DataParallelModel` (`elastic.worker.data_parallel`): one whole copy per rank, its gradients
  averaged by DDP's hook; ZeRO-1 and local SGD keep the plain module;
- `ShardedModel` (same module): ZeRO-2/3, the parameters sharded by FSDP2;
- `ReplicaModel` (`elastic.parallel.replica_model`) and its kinds: a pipeline stage
  (`PipelinedKind`), tensor-parallel slices (`TensorParallelKind`), or both (3D), whose replicas
  average their gradients themselves.

The base class's methods are what a kind does where it has nothing of its own to do. It lives
here, below the worker's runtime, so that the kinds of `elastic.parallel` and of the worker can
share it; what a kind needs of the runtime comes in a `WorkerPlace` and a `Generation`. A new kind
is one new module with a subclass and one line in `model_kinds.prepare`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.checkpoint import Part
from elastic.comm.group import GenerationSpec
from elastic.comm.state_sync import RunState, SyncResult
from elastic.config import Strategy
from elastic.errors import ElasticError
from elastic.parallel.replicas import ReplicaShape


@dataclass(frozen=True)
class WorkerPlace:
    """Where a model is prepared: the worker's place in its replica, for its whole life, and the run's settings."""

    shape: ReplicaShape
    slot: int
    device: torch.device
    strategy: Strategy


@dataclass(frozen=True)
class ComputeFrames:
    """What the hang probe must not take for a wait on peers in a kind's train thread: the torch.distributed
    modules whose frames are its compute (DTensor dispatching a local op, a schedule running a model's layers),
    and of their functions the ones that do wait on peers."""

    modules: tuple[str, ...] = ()
    waits: tuple[str, ...] = ()


DTENSOR = "torch.distributed.tensor"  # the kinds whose parameters are DTensors compute in its frames


@dataclass(frozen=True)
class Generation:
    """What a prepared model binds to in one generation, given by the worker's membership."""

    spec: GenerationSpec
    average: Callable[[torch.Tensor], None]  # sums a flat gradient buffer across the replicas, abortably
    agree: Callable[[], None]  # returns once every rank averaged its gradients (`GradientAllReduce.agree`)
    # DDP's all-reduce of one bucket as (state, hook) for `register_comm_hook`, where a technique routes it
    comm_hook: tuple[Any, Callable[[Any, Any], torch.futures.Future]] | None
    # Called inside DDP's gradient all-reduce (the faults injected there), without changing its path
    inside_all_reduce: Callable[[], None] | None = None


class PreparedModel:
    """What the worker's runtime asks of a prepared model, whatever its kind."""

    returned: Any = None  # what prepare_model gives the train loop (None: no model prepared yet)
    abortable = False  # its groups must be abortable on gloo at any world size
    needs_full_steps = False  # refuses a dataset whose epochs end with a short step
    part_name = ""  # the part of a checkpoint it writes and restores ("": the whole model, rank 0's)
    compute_frames = ComputeFrames()  # torch.distributed's frames that are its compute (the hang probe reads them)

    def connect(self, spec: GenerationSpec) -> dist.ProcessGroup | None:
        """Form its groups of `spec`'s generation while the world forms; its data-parallel group (None: the world)."""
        return None

    def bind(self, generation: Generation) -> None:
        """Join the generation before any state moves."""

    def synced(self, sync: SyncResult, step: int, random: Any) -> SyncResult:
        """Check the state sync (over the data-parallel group) and name its source as a global rank."""
        return sync

    def start(self, generation: Generation) -> bool:
        """Train in the synced generation; True where DDP's gradient all-reduce runs `generation.comm_hook`."""
        return False

    def unbind(self) -> list[Any]:
        """Leave the generation: what held its process groups, for the membership to let go of."""
        return []

    def accumulating(self, last: bool) -> AbstractContextManager:
        """Held while the train loop has a micro-batch: gradients sync only in the step's `last` one's backward."""
        return nullcontext()

    def after_last_backward(self, step: Any) -> Callable[[], None] | None:
        """Called after the backward of the step's last micro-batch (a replica averages there), if anything."""
        return None

    def check_micro_batches(self) -> None:
        """Refuse `step.micro_batches()` where the kind takes the step's share as one batch."""

    def batch(self, step: Any, load: Callable[[], list], on_sync: Callable[[], None]) -> Any:
        """The replica's share of `step` as one batch (`step.batch()`), from the micro-batches `load()` gives."""
        raise ElasticError("step.batch() gives a pipelined run's replica its share (ScalingConfig(pipeline_stages "
                           "> 1)); iterate step.micro_batches() and call mb.backward(loss) instead")

    def unweighted_error(self, step: Any) -> ElasticError | None:
        """The kind's error when the optimizer steps before every batch of `step` was backpropagated
        (None: the micro-batches' own)."""
        return None

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, state: RunState,
                          current_step: Callable[[], Any]) -> None:
        """Register what the kind syncs of `optimizer` on `state`, and hook its per-step average."""

    def checkpoint_part(self, replica: int, replicas: int) -> Part | None:
        """The part of a checkpoint this worker writes (None: the whole model, rank 0's)."""
        return None

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on the CPU, under the given model's names: a collective of every rank."""
        raise ElasticError("ctx.model_state_dict() gives the prepared model's state: call ctx.prepare_model(model) "
                           "first")
