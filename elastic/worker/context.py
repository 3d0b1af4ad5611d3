"""The train loop's view of the run: ranks, prepared model and optimizer, steps and reports.

Inside `train_loop`, a user writes

    ctx = elastic.get_context()
    model = ctx.prepare_model(MyModel())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in ctx.steps(dataset):
        with step:
            for mb in step.micro_batches():
                mb.backward(loss_fn(model(mb.data[0]), mb.data[1]))
            optimizer.step()
            optimizer.zero_grad()
        elastic.report({"loss": ...})

Between two iterations the context may move the worker to a new generation: after a peer
died (the `with step` block swallows the collective error and the step is redone) or because
the controller grows the run (all ranks switch at the step boundary the controller committed,
see `elastic.worker.mailbox`). The step commits when the prepared optimizer steps; the data cursor
moves only then.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from elastic.checkpoint import reported
from elastic.checkpoint.checkpoint import (
    Checkpoint, CheckpointError, CheckpointWriter, Part, join_slices, part_name, take_snapshot,
)
from elastic.comm.collectives import Collectives
from elastic.comm.flat_state import reduce_in_place
from elastic.comm.group import (
    ABORTABLE_FROM_WORLD_SIZE,
    PEER_ABORT_MARKER,
    GenerationSpec,
    GradientAllReduce,
    StoreClient,
    abort_communicator,
    form_group,
    is_peer_failure,
    leave_group,
    rendezvous,
)
from elastic.comm.links import GroupLinks
from elastic.comm.state_sync import load_into, state_of, sync_state
from elastic.config import CheckpointConfig, DataConfig, Strategy
from elastic.data import order as data_math
from elastic.data.loader import Loader, open_loader, to_device
from elastic.data.stream import StreamLoader
from elastic.errors import ElasticError, StateLostError, UnweightedBackwardError, WorkerEvictedError
from elastic.faults import Fault
from elastic.parallel.replicas import Position, ReplicaShape
from elastic.techniques.strategy import Techniques
from elastic.worker.injection import FaultInjector
from elastic.worker.mailbox import GenerationMailbox
from elastic.worker.random_state import RandomState
from elastic.worker.step import BetweenSteps, ElasticDDP, MicroBatch, Step

if TYPE_CHECKING:
    from elastic.parallel.pipelined_replica import PipelinedReplica, ReplicaBatch
    from elastic.parallel.tensor_parallel import Plan
    from elastic.parallel.tensor_parallel_replica import TensorParallelReplica

# Steps between the boundary all-reduces that agree on time-based checkpoints (only runs with
# CheckpointConfig(every_s) launch them). The step index decides, so every rank checks at the
# same boundaries; rarer checks cost less step time.
AGREEMENT_EVERY_STEPS = 8

_current: "TrainContext | None" = None
# torch.distributed modules whose frames are mostly compute (a pipeline schedule running a stage's
# layers, DTensor dispatching a local op), and of their functions the ones that wait on peers.
COMPUTING = ("torch.distributed.pipelining", "torch.distributed.tensor")
WAITS = ("_wait_batch_p2p",)  # torch's schedules wait on a batch of sends and receives here


def get_context() -> "TrainContext":
    """The context of the train loop running in this worker."""
    if _current is None:
        raise ElasticError("get_context() is only available inside a train_loop run by ElasticTrainer.fit()")
    return _current


def report(metrics: dict[str, Any], checkpoint: Any = None) -> None:
    """Record metrics of the current step; never blocks on the network.

    `checkpoint` (rank 0 only; a local directory's path, or anything with Ray Train's
    `as_directory()`) is read at once and stored in the run's next checkpoint and every later
    one, until rank 0 reports another: see `elastic.checkpoint.reported`.
    """
    get_context().report(metrics, checkpoint)


def get_checkpoint() -> Checkpoint | None:
    """The run's latest complete checkpoint if it holds a directory rank 0 reported, else None
    (as on a fresh run); read its files with `as_directory()` or `to_directory()`."""
    return get_context().get_checkpoint()


class TrainContext:
    """Per-worker runtime of one run; created by the worker actor, reached via get_context()."""

    def __init__(
        self,
        data_config: DataConfig,
        mailbox: GenerationMailbox,
        faults: list[Fault],
        report_sink: Callable[[dict[str, Any]], None],
        use_gpu: bool,
        checkpoint_config: CheckpointConfig = CheckpointConfig(),
        writer: CheckpointWriter | None = None,
        on_fault: Callable[[Fault], None] = lambda fault: None,
        strategy: Strategy = Strategy(),
        latest_checkpoint: Callable[[], Checkpoint | None] = lambda: None,
        shape: ReplicaShape = ReplicaShape(),
        slot: int = 0,
    ) -> None:
        if checkpoint_config.enabled and writer is None:
            raise ElasticError("a checkpoint schedule needs a CheckpointWriter")
        self.data_config = data_config
        self.checkpoint_config = checkpoint_config
        self._writer = writer
        self._on_fault = on_fault
        self._checkpoint_files: dict[str, bytes] = {}
        self._checkpoint_metadata: dict[str, Any] = {}
        # The latest directory rank 0 reported, which rank 0 writes into every checkpoint; None
        # until this worker reported one or, as rank 0, took the latest checkpoint's.
        self._reported_files: dict[str, bytes] | None = None
        self._latest_checkpoint = latest_checkpoint  # asks the controller
        self._last_checkpoint = time.monotonic()
        self.checkpoint: Checkpoint | None = None
        self._launched = 0
        self._entered_sync = 0
        self._arrived = -1  # the newest generation whose barrier this rank reached
        self._connected = -1  # the newest generation whose groups this rank connected
        self._train_thread: int | None = None
        self._waiting_on_checkpoint = False
        # The current generation's number, default group and connections (to sever, `abort_stale_group`).
        self._group: tuple[int, dist.ProcessGroup, GroupLinks] | None = None
        self._gradient_all_reduce: GradientAllReduce | None = None  # the current group's, abortable
        self._collectives: Collectives | None = None  # the train loop's, for the current generation
        self._holds_state = False  # synced in a generation before: holds the run's live state
        self._group_lock = threading.Lock()
        self._compute_s = 0.0
        self.mailbox = mailbox
        self.faults = FaultInjector(faults, self._claim)
        self._report_sink = report_sink
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        self.strategy = strategy
        self.techniques = Techniques(strategy, self.device, data_config.max_steps, data_config.seed)
        self._hooked = False  # DDP's all-reduce goes through `_allreduce_hook`, which counts its bytes
        self._rolled_back = 0
        self.spec: GenerationSpec | None = None
        self._store = StoreClient()
        self._model: ElasticDDP | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._random = RandomState()
        self._objects: dict[str, Any] = {"rng": self._random}
        self._step_index = 0
        self._cursor = data_math.DataCursor(seed=data_config.seed)
        self._current_step: Step | None = None
        self._inside_step = False  # between a step's __enter__ and __exit__
        self._flag: tuple[dist.Work, torch.Tensor] | None = None
        self._loader: Loader | StreamLoader | None = None
        self.shape = shape  # workers per replica; a pipelined run's replica is the elastic unit
        self._slot = slot  # this worker's place in its replica, for its whole life: its pipeline stage
        self._pipeline: PipelinedReplica | None = None
        self._tensor: TensorParallelReplica | None = None
        self._position: Position | None = None  # its replica and stage in the current generation
        self._data_group: dist.ProcessGroup | None = None  # the same stage of every replica, this generation
        self._mesh_groups: dict[str, dist.ProcessGroup] = {}  # this generation's "pp" and "tp", where present
        self.final_model: dict[str, torch.Tensor] | None = None  # rank 0's: the whole model once max_steps ran

    # --- what the train loop sees ------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.spec.rank if self.spec else -1

    @property
    def world_size(self) -> int:
        return self.spec.world_size if self.spec else 0

    @property
    def local_rank(self) -> int:
        return self.spec.local_rank if self.spec else -1

    @property
    def num_replicas(self) -> int:
        """Replicas in the current generation: the data-parallel size (the world size without pipeline stages)."""
        return self.world_size // self.shape.size

    @property
    def replica_rank(self) -> int:
        """This worker's replica in the current generation: its data-parallel rank."""
        return self._position.replica if self._position else self.rank

    @property
    def pipeline_stage(self) -> int:
        """The pipeline stage this worker holds (0 without pipeline stages)."""
        return self._slot // self.shape.tensor_parallel

    @property
    def tensor_parallel_rank(self) -> int:
        """This worker's rank in its replica's tensor-parallel group (0 without tensor parallelism)."""
        return self._slot % self.shape.tensor_parallel

    @property
    def pipelined(self) -> bool:
        return self.shape.pipeline_stages > 1

    @property
    def in_replicas(self) -> bool:
        """Replicas of several workers are the run's data-parallel peers (pipeline stages or tensor parallelism)."""
        return self.shape.size > 1

    @property
    def generation(self) -> int:
        return self.spec.generation if self.spec else -1

    @property
    def step(self) -> int:
        """Optimizer steps committed so far in the run."""
        return self._step_index

    @property
    def links(self) -> tuple[int, GroupLinks] | None:
        """The current generation's number and its groups' connections; read from any thread."""
        group = self._group
        return (group[0], group[2]) if group is not None else None

    def prepare_model(self, model: torch.nn.Module,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                      tensor_parallel_plan: Plan | None = None, split_points: Sequence[int] | None = None
                      ) -> ElasticDDP | PipelinedReplica | TensorParallelReplica:
        """Register `model` for healing and wrap it in DDP; call before `steps()`.

        Under Strategy(zero=2 or 3) each generation shards it with FSDP2 instead: the returned
        module then holds that generation's sharded module (DTensor parameters) as `module`.
        With ScalingConfig(pipeline_stages > 1), `model` is an nn.Sequential cut into that many
        stages and `loss_fn(outputs, targets)` the mean loss the last stage computes: the
        returned `PipelinedReplica` holds this worker's stage (elastic.parallel.pipelined_replica); the
        stages are cut evenly by layer count, or where `split_points` say (the index of the layer
        each stage after the first begins with).
        With ScalingConfig(tensor_parallel > 1), `tensor_parallel_plan` (by default the model's
        `tensor_parallel_plan()`) cuts its layers across the replica's workers: the returned
        `TensorParallelReplica` holds this worker's slices (elastic.parallel.tensor_parallel_replica).
        """
        if self._model is not None or self._pipeline is not None or self._tensor is not None:
            raise ElasticError("prepare_model() was called twice; elastic syncs one model per run")
        if tensor_parallel_plan is not None and self.shape.tensor_parallel == 1:
            raise ElasticError("prepare_model(model, tensor_parallel_plan=...) takes a plan only in a tensor-parallel "
                               "run (ScalingConfig(tensor_parallel > 1))")
        if split_points is not None and not self.pipelined:
            raise ElasticError("prepare_model(model, split_points=...) cuts pipeline stages: it takes split points "
                               "only in a pipelined run (ScalingConfig(pipeline_stages > 1))")
        if self.pipelined:
            return self._prepare_pipeline(model, loss_fn, tensor_parallel_plan, split_points)
        if self.shape.tensor_parallel > 1:
            return self._prepare_tensor_parallel(model, tensor_parallel_plan)
        if loss_fn is not None:
            raise ElasticError("prepare_model(model, loss_fn) takes a loss_fn only in a pipelined run "
                               "(ScalingConfig(pipeline_stages > 1)); compute the loss in the train loop instead")
        model.to(self.device)
        self._model = ElasticDDP(self, model)
        self._objects["model"] = model
        self.techniques.prepare_model(model, self._objects)
        if self.techniques.sharded is not None:
            # Each generation's FSDP2 module replaces the last one as the prepared model's `module`.
            self.techniques.sharded.on_rebuilt = lambda module: setattr(self._model, "module", module)
        return self._model

    def _prepare_pipeline(self, model: torch.nn.Module, loss_fn: Callable | None, plan: Plan | None,
                          split_points: Sequence[int] | None) -> PipelinedReplica:
        from elastic.parallel.pipelined_replica import PipelinedReplica  # torch's pipelining: seconds to import

        if loss_fn is None:
            raise ElasticError(f"with pipeline_stages({self.shape.pipeline_stages}) the last stage computes the loss: "
                               "call ctx.prepare_model(model, loss_fn=...), e.g. loss_fn=nn.functional.mse_loss, "
                               "a function of (outputs, targets) returning their mean loss")
        if self.shape.tensor_parallel > 1:
            plan = self._plan_of(model, plan)
        self._pipeline = PipelinedReplica(model, loss_fn, stages=self.shape.pipeline_stages,
                                          stage=self.pipeline_stage, microbatches=self.strategy.pipeline_microbatches,
                                          schedule=self.strategy.pipeline_schedule,
                                          tensor_parallel=self.shape.tensor_parallel, plan=plan,
                                          split_points=split_points)
        self._pipeline.module.to(self.device)  # this stage only: the others' layers are dropped
        self._tensor = self._pipeline.tensor  # its slices, when its stage is tensor parallel
        self._objects["model"] = self._pipeline
        return self._pipeline

    def _plan_of(self, model: torch.nn.Module, plan: Plan | None) -> Plan:
        if plan is not None:
            return plan
        if not callable(getattr(model, "tensor_parallel_plan", None)):
            raise ElasticError(
                f"with tensor_parallel({self.shape.tensor_parallel}) the model's layers are cut by a plan: call "
                "ctx.prepare_model(model, tensor_parallel_plan=...), e.g. elastic.parallel.tensor_parallel.mlp_plan("
                "'0', '2') for a Sequential's Linear pair, or give the model a tensor_parallel_plan() method")
        return model.tensor_parallel_plan()

    def _prepare_tensor_parallel(self, model: torch.nn.Module, plan: Plan | None) -> TensorParallelReplica:
        from elastic.parallel.tensor_parallel_replica import TensorParallelReplica  # DTensor: a second to import

        plan = self._plan_of(model, plan)
        model.to(self.device)
        self._tensor = TensorParallelReplica(model, plan, self.shape.tensor_parallel)
        self._objects["model"] = self._tensor
        return self._tensor

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register `optimizer` for healing; its `step()` commits the current global step.

        Step the optimizer this returns: under Strategy(zero=1) it is a `ShardedOptimizer`
        around yours, whose state is sharded across the ranks rather than synced whole; under
        zero=2 or 3 a `ShardedParamsOptimizer` stepping your optimizer's class over the shards.
        """
        if self._optimizer is not None:
            raise ElasticError("prepare_optimizer() was called twice; elastic syncs one optimizer per run")
        optimizer = self._optimizer = self.techniques.prepare_optimizer(optimizer, self._objects)
        optimizer.register_step_pre_hook(lambda *_: self._check_weighted())
        if self._tensor is not None:
            from elastic.parallel.tensor_parallel_replica import LocalSlices

            self._tensor.tp.adopt(optimizer)  # each generation's bind carries it to the new module
            self._objects["optimizer"] = LocalSlices(optimizer)
            if not self.pipelined:  # a pipelined stage averages in model.step
                # The last micro-batch's mb.backward averages; this averages a step whose loop
                # stopped before it, or a replica that got no micro-batch.
                optimizer.register_step_pre_hook(lambda *_: self._average_slices(self._current_step))
        optimizer.register_step_post_hook(lambda *_: self._commit())
        return optimizer

    def _check_weighted(self) -> None:
        """Before the optimizer steps: every micro-batch of the step went through mb.backward."""
        step = self._current_step
        if step is not None and step.weighted < step.given and self.pipelined:
            raise UnweightedBackwardError(f"step {step.index}: the optimizer steps before model.step(batch) ran the "
                                          "replica's batch: call loss = model.step(step.batch()) first")
        if step is not None and step.weighted < step.given:
            raise UnweightedBackwardError(
                f"step {step.index}: {step.given - step.weighted} of the {step.given} micro-batches were "
                "backpropagated without mb.backward(loss); a plain loss.backward() leaves out the micro-batch's "
                "weight (its share of the global batch), so the gradients would be wrong at this world size. "
                "Call mb.backward(loss) for every micro-batch of step.micro_batches()"
            )

    def autocast(self):
        """The run's autocast (`Strategy.precision`), for work outside the prepared model's forward."""
        return self.techniques.precision.autocast()

    @property
    def collectives(self) -> Collectives:
        """all_reduce, sample_mean, all_gather, broadcast, reduce_scatter and all_to_all over the
        current generation's group; a peer's death inside one heals like any in a step, and
        outside a step only inside `ctx.between_steps()`."""
        if self.spec is None:
            raise ElasticError("ctx.collectives is used before ctx.steps() formed the first generation")
        if self._collectives is None or self._collectives.generation != self.generation:
            self._collectives = Collectives(self.generation, lambda: self.generation)
        return self._collectives

    def between_steps(self) -> BetweenSteps:
        """Guard collectives called outside `with step` (an evaluation loop): a peer's death in
        them heals, as in a step, instead of failing the run. Run the block again while
        `block.failed` is set, to have its result at the new world size."""
        if self._inside_step:
            raise ElasticError("ctx.between_steps() is used inside `with step`, which heals a peer's death itself "
                               "(and must not move to a new generation halfway through a step); use it outside the step")
        if self.spec is None:
            raise ElasticError("ctx.between_steps() is used before ctx.steps() formed the first generation")
        return BetweenSteps(self)

    @property
    def communication(self) -> dict[str, int]:
        """What this rank sent to keep the replicas in step so far: `sync_bytes` handed to DDP's
        gradient all-reduce (after compression) or to local SGD's syncs, and `outer_syncs`."""
        return self.techniques.communication()

    def synced_state(self) -> dict[str, Any]:
        """The state of everything a heal or a grow syncs (model, optimizer, registered state,
        the technique's), by name: the same on every rank of a generation."""
        return {name: state_of(obj) for name, obj in self._objects.items()}

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole prepared model's state dict, on the CPU, on every rank: in any layout, the
        same names and tensors as the model given to `prepare_model`.

        A collective, as torch's own full-state-dict helpers are: call it on every rank at the
        same point of the loop. ZeRO-2/3's parameter shards are gathered (every rank takes part
        in each gather), a tensor-parallel stage's slices joined along their cut dimensions, and a
        pipelined replica's stages joined under their layers' names.
        """
        model = self._objects.get("model")
        if model is None:
            raise ElasticError("ctx.model_state_dict() gives the prepared model's state: call ctx.prepare_model(model) "
                               "first")
        if not self.in_replicas:
            return {name: _whole(tensor) for name, tensor in self._model.module.state_dict().items()}
        part = state_of(model)  # this worker's stage, or its slices of the stage and the dimension each is cut along
        if self._tensor is not None:
            slices = [None] * self.shape.tensor_parallel
            dist.all_gather_object(slices, _on_cpu(part), group=self._mesh_groups["tp"])
            part = join_slices(slices)
        if self.pipelined:
            stages = [None] * self.shape.pipeline_stages
            dist.all_gather_object(stages, _on_cpu(part), group=self._mesh_groups["pp"])
            part = {name: tensor for stage in stages for name, tensor in stage.items()}
        return part

    def register_state(self, name: str, obj: Any) -> None:
        """Sync another stateful object (a tensor, or anything with state_dict/load_state_dict)."""
        if name in self._objects or name == "data_stream":
            raise ElasticError(f"state {name!r} is already registered; pick another name (elastic registers "
                               "'rng', and 'data_stream' for an iterable dataset's position)")
        self._objects[name] = obj

    def add_checkpoint_file(self, name: str, data: bytes) -> None:
        """Store `data` as file `name` in every checkpoint from now on; read it with Checkpoint.read_file."""
        if not name or "/" in name or name.startswith("."):
            raise ElasticError(f"checkpoint file name {name!r} must be a plain file name")
        self._checkpoint_files[name] = bytes(data)

    def set_checkpoint_metadata(self, **metadata: Any) -> None:
        """JSON-able values stored in the manifest of every checkpoint from now on."""
        self._checkpoint_metadata.update(metadata)

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        if checkpoint is not None:
            self._reported_files = reported.files_to_store(checkpoint, self.rank, self.checkpoint_config)
        self._report_sink(
            {"kind": "metrics", "step": self._step_index, "rank": self.rank, "time": time.time(), "metrics": metrics}
        )

    def get_checkpoint(self) -> Checkpoint | None:
        """See `elastic.get_checkpoint`."""
        latest = self._latest_checkpoint()
        return latest if latest is not None and latest.reported_files() else None

    def steps(self, dataset: Any) -> Iterator[Step]:
        """Yield each remaining global step of the run, healing and rescaling in between."""
        self._loader = open_loader(dataset, self.data_config, pin_memory=self.device.type == "cuda")
        if self.pipelined and isinstance(self._loader, Loader):
            self._check_full_steps(self._loader.num_samples)
        if isinstance(self._loader, StreamLoader):
            self._objects["data_stream"] = self._loader  # its position is synced and checkpointed
        self._train_thread = threading.get_ident()
        self._join(reason="start")
        max_steps = self.data_config.max_steps
        while self._step_index < max_steps:
            if self._read_flag():
                self._checkpoint()
            switch = self.mailbox.at_boundary(self._step_index, self.generation)
            if switch is not None:
                self._join(reason="rescale")
                continue
            self.faults.at("step_start", self.rank, self._step_index, self._compute_s)
            self._random.mark()
            self._cursor = self._loader.settle(self._cursor)
            step = Step(self, self._step_index, self._cursor, self._loader.step_samples(self._cursor))
            self._current_step = step
            yield step
            self._current_step = None
            if not step.entered:
                raise ElasticError("each step from ctx.steps() must be used as `with step:`")
            if step.failed is not None:
                self._flag = None
                self._join(reason="heal", lost=0 if step.committed else 1)
                continue
            if self.techniques.sync_due(self._step_index) and not self._outer_sync():
                continue
            every = self.checkpoint_config.every_steps
            if self._step_index == max_steps and self.checkpoint_config.enabled:
                self._checkpoint()
            elif every and self._step_index % every == 0:
                self._checkpoint()
            timed = self.checkpoint_config.every_s is not None
            if timed and self._step_index < max_steps and self._step_index % AGREEMENT_EVERY_STEPS == 0:
                self._launch_flag()
        self._flag = None
        self._keep_final_model()
        self._loader.close()
        self._wait_for_writer()

    def _keep_final_model(self) -> None:
        """Once the last step committed, rank 0 keeps the whole model (`Result.model_state_dict()`)."""
        if "model" not in self._objects:
            return
        try:
            whole = self.model_state_dict()
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            return  # a peer died at the very end: the Result says there is no whole model, and why
        if self.rank == 0:
            self.final_model = whole

    def _outer_sync(self) -> bool:
        """Local SGD's sync after an interval's last step; False if a peer died in it (healed)."""
        try:
            self.techniques.outer_sync(self._objects, {"step": self._step_index, "cursor": self._cursor.to_dict()})
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            self._flag = None
            self._join(reason="heal")
            return False
        return True

    def _wait_for_writer(self) -> None:
        """Wait for the previous checkpoint's upload; the hang check counts this as progress."""
        if self._writer is None:
            return
        self._waiting_on_checkpoint = True
        try:
            self._writer.wait()
        finally:
            self._waiting_on_checkpoint = False

    # --- steps and micro-batches -------------------------------------------------------
    def _micro_batches(self, step: Step) -> Iterator[MicroBatch]:
        if self.pipelined:
            raise ElasticError("in a pipelined run the stages take the replica's share as one batch, which the "
                               "schedule cuts into micro-batches: use `batch = step.batch()` and `model.step(batch)`")
        # In replicas, every worker of a replica computes on the replica's share.
        peers, peer = (self.num_replicas, self.replica_rank) if self.in_replicas else (step.world_size, step.rank)
        loaded = self._loader.step(step.cursor, peers, peer)
        ddp = self._model.ddp if self._model else None
        if self.faults.slow_extra_s:
            time.sleep(self.faults.slow_extra_s)  # an injected straggler
        for i, micro in enumerate(loaded):
            batch = MicroBatch(
                data=to_device(micro.data, self.device),
                indices=micro.indices,
                weight=data_math.gradient_weight(micro.samples, peers, step.samples),
                on_sync=(lambda: self._enter_sync(step)) if i == len(loaded) - 1 else None,
                synced=(lambda: self._average_slices(step)) if self._tensor is not None and i == len(loaded) - 1
                else None,
                run_backward=self.techniques.precision.backward,
            )
            last = i == len(loaded) - 1
            if self.techniques.sharded is not None:
                self.techniques.sharded.set_requires_gradient_sync(last)
            if ddp is not None and not last:
                with ddp.no_sync():
                    yield batch
            else:
                yield batch

    def _check_full_steps(self, samples: int) -> None:
        """A pipelined replica cuts its share into equal micro-batches, so no step may be short."""
        global_batch = self.data_config.global_batch_size
        if not self.data_config.drop_last and samples % global_batch:
            raise ElasticError(
                f"the dataset has {samples} samples, so each epoch ends with a step of {samples % global_batch}, short "
                f"of global_batch_size({global_batch}), which the replicas cannot cut into equal micro-batches: set "
                "DataConfig(drop_last=True), or give a dataset of a multiple of global_batch_size samples")

    def _replica_batch(self, step: Step) -> ReplicaBatch:
        """The replica's share of `step` as one batch, which every stage of the replica reads alike."""
        from elastic.parallel.pipelined_replica import ReplicaBatch, concatenated

        if not self.pipelined:
            raise ElasticError("step.batch() gives a pipelined run's replica its share (ScalingConfig(pipeline_stages "
                               "> 1)); iterate step.micro_batches() and call mb.backward(loss) instead")
        replicas, replica = self.num_replicas, self._position.replica
        loaded = [micro for micro in self._loader.step(step.cursor, replicas, replica) if micro.samples]
        if self.faults.slow_extra_s:
            time.sleep(self.faults.slow_extra_s)  # an injected straggler
        samples = sum(micro.samples for micro in loaded)
        if samples == 0 or samples % self.strategy.pipeline_microbatches:
            raise ElasticError(
                f"step {step.index} gives replica {replica} of {replicas} {samples} samples, which do not cut into "
                f"pipeline_microbatches({self.strategy.pipeline_microbatches}) equal micro-batches (the epoch's last "
                "step is short when the dataset's size is not a multiple of global_batch_size): set "
                "DataConfig(drop_last=True), or give a dataset of a multiple of global_batch_size samples")
        return ReplicaBatch(
            data=to_device(concatenated([micro.data for micro in loaded]), self.device),
            indices=torch.cat([micro.indices for micro in loaded]),
            weight=samples / step.samples,  # the replicas' weighted gradients sum to the step's mean
            on_sync=lambda: self._backpropagated(step))

    def _backpropagated(self, step: Step) -> None:
        step.weighted += 1
        self._enter_sync(step)

    def _average_over_replicas(self, flat: torch.Tensor) -> None:
        """Sum a flat gradient buffer across the replicas, abortable like DDP's all-reduce."""
        self.faults.at("allreduce", self.rank, self.step)
        future = self._gradient_all_reduce.all_reduce(flat, self._data_group)
        self._launched += 1
        future.wait()

    def _average_slices(self, step: Step | None) -> None:
        """Once a tensor-parallel step's last micro-batch is backpropagated, as DDP averages in its
        backward (so clipping and logging see the global batch's gradient): each local gradient
        averaged with the same tensor-parallel rank of every replica (the micro-batches' weights make
        the mean the global batch's). Once per step."""
        from elastic.parallel.tensor_parallel_replica import local_gradients

        if step is None or step.averaged:
            return
        step.averaged = True
        reduce_in_place(local_gradients(self._tensor.module), self._average_over_replicas, divide=self.num_replicas)
        self._all_averaged()  # as PipelinedReplica.step: no rank steps while another's average failed

    def _all_averaged(self) -> None:
        """Return once every rank of the generation averaged its stage's gradients (see `GradientAllReduce.agree`)."""
        store = self._store.get(self.spec.store_host, self.spec.store_port)
        self._gradient_all_reduce.agree(store, self._step_index, self.spec.world_size)

    def _commit(self) -> None:
        step = self._current_step
        if step is None or step.committed:
            return
        step.committed = True
        self.techniques.committed()
        self._step_index += 1
        self._cursor = self._loader.advance(self._cursor)

    def _end_step(self, step: Step, exc: BaseException | None) -> bool:
        if exc is None:
            self._commit()
            if step.compute_s is not None:
                self._compute_s = step.compute_s - self.faults.slow_extra_s
            self._report_sink(
                {
                    "kind": "step",
                    "step": step.index,
                    "rank": step.rank,
                    "world_size": step.world_size,
                    "generation": self.generation,
                    "step_s": time.perf_counter() - step.started,
                    "compute_s": step.compute_s,
                    "samples": step.samples,
                    "time": time.time(),
                }
            )
            return False
        aborted = self._gradient_all_reduce is not None and self._gradient_all_reduce.aborted is not None
        if aborted or is_peer_failure(exc):
            # Keep the message, not the exception: its traceback would keep the old DDP alive.
            step.failed = f"{type(exc).__name__}: {exc}"
            if not step.committed and self._optimizer is not None:
                self._optimizer.zero_grad(set_to_none=True)
            if not step.committed:
                self.techniques.failed()
                self._random.rewind()
            return True
        return False

    # --- generations ---------------------------------------------------------------------
    def _launch_flag(self) -> None:
        """Start the all-reduce that makes every rank agree whether a timed checkpoint is due.

        Each rank contributes whether its checkpoint timer ran out; the MAX is read at the next
        boundary, so all ranks snapshot the same step while training never waits for the check.
        """
        timer_due = time.monotonic() - self._last_checkpoint >= self.checkpoint_config.every_s
        flag = torch.tensor([int(timer_due)], dtype=torch.int64, device=self.device)
        self._flag = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)

    def _read_flag(self) -> bool:
        """Whether the ranks agreed on a checkpoint at this boundary."""
        if self._flag is None:
            return False
        work, flag = self._flag
        self._flag = None
        try:
            work.wait()
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            self._join(reason="heal", lost=0)
            return False
        return bool(flag.item())

    def _checkpoint(self) -> None:
        """Snapshot to CPU (training waits only for this copy) and write the shard in the background."""
        started = time.perf_counter()
        kept = self.techniques.checkpoint_state(self._objects, {"step": self._step_index,
                                                                "cursor": self._cursor.to_dict()})
        if kept is None:
            return  # local SGD has not synced since the last checkpoint: nothing new to keep
        snapshot = take_snapshot(*kept)
        if self.rank == 0 and self._reported_files is None:
            # A new rank 0 (after a heal or a restart) carries the directory the old one reported.
            latest = self._latest_checkpoint()
            self._reported_files = latest.read_reported() if latest is not None else {}
        optimizer_shard = self.techniques.optimizer_shard()
        crash = self.faults.crash_checkpoint(self.rank, self._step_index)
        self._wait_for_writer()  # one upload at a time: back-pressure, reported as progress
        self._writer.submit(snapshot, self.rank, self.world_size, time.perf_counter() - started,
                            self._checkpoint_files, self._checkpoint_metadata, crash_midway=crash,
                            optimizer_shard=optimizer_shard, reported_files=self._reported_files,
                            generation=self.generation,
                            part=Part(self._checkpoint_part, self.replica_rank, self.num_replicas) if self.in_replicas
                            else None)
        self._last_checkpoint = time.monotonic()

    @property
    def _checkpoint_part(self) -> str:
        """The part of a checkpoint this worker writes and restores: its stage's, in a pipelined run."""
        return part_name(self.shape.pipeline_stages, self.shape.tensor_parallel, self._slot)

    def _join(self, reason: str, lost: int = 0) -> None:
        """Leave the current generation and join the newest one the controller offers.

        A generation that is aborted before every member arrived, or that fails to connect,
        is given up and the next offer waited for; only a user error escapes.
        """
        left = time.perf_counter()
        if reason == "heal":
            self._leave()
            self.mailbox.report_broken(self.generation)
        tried = self.generation
        while True:
            spec = self.mailbox.wait_newer(tried)
            tried = spec.generation
            try:
                timings = self._form(spec, left)
            except WorkerEvictedError:
                raise
            except Exception as exc:
                state_lost = isinstance(exc, StateLostError)
                self.mailbox.formed(spec.generation, {"ok": False, "state_lost": state_lost,
                                                      "error": f"{type(exc).__name__}: {exc}"})
                if not (state_lost or is_peer_failure(exc)):
                    raise
                continue  # the controller offers another generation: a restart, if state was lost
            if timings is None:
                continue  # aborted: a member died or left before everyone arrived
            self.mailbox.formed(spec.generation, {
                "ok": True, "step": self._step_index, "steps_lost": lost + self._rolled_back, "reason": reason,
                "source_rank": self._last_sync.source_rank, **timings,
            })
            return

    def _leave(self) -> None:
        # Nothing may keep the old group alive: see leave_group.
        self._flag = None
        if self._model is not None:
            self._model.ddp = None
        held = [self._data_group, *(self._pipeline.unbind() if self._pipeline is not None else [])]
        self._data_group = None
        self._mesh_groups = {}
        with self._group_lock:
            self._group = None
        if self._gradient_all_reduce is not None:
            self._gradient_all_reduce.abort(
                f"{PEER_ABORT_MARKER}: generation {self._gradient_all_reduce.generation} was left")
            self._gradient_all_reduce = None
        leave_group(self.spec.backend if self.spec else "gloo", held)

    def _form(self, spec: GenerationSpec, left: float) -> dict[str, float] | None:
        """Join `spec`'s generation and sync state; the phases' seconds, or None if it was aborted.

        `left` is when this rank stopped training (its step failed, or it reached the switch).
        """
        self._leave()
        store = self._store.get(spec.store_host, spec.store_port)
        self.spec = spec
        self.faults.at("barrier", spec.rank, self._step_index)
        self._arrived = spec.generation
        started = time.perf_counter()
        if not rendezvous(spec, store):
            return None
        arrived = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        groups: dict[str, dist.ProcessGroup] = {}

        def connect() -> None:
            form_group(spec, store)
            if self.in_replicas:
                groups.update(self._replica_groups(spec))

        links = GroupLinks.opened_by(connect)
        self._connected = spec.generation
        with self._group_lock:
            self._group = (spec.generation, dist.group.WORLD, links)
        abortable = spec.backend == "gloo" and (spec.world_size >= ABORTABLE_FROM_WORLD_SIZE or self.in_replicas)
        data_group = groups.get("dp")
        if self._tensor is not None:
            # Before any state moves: the state is this generation's local slices.
            self._tensor.bind(groups["tp"])
        self._data_group = data_group
        self._mesh_groups = {dim: group for dim, group in groups.items() if dim != "dp"}
        self._gradient_all_reduce = GradientAllReduce(spec.generation, abortable)
        connected = time.perf_counter()
        if spec.restart:
            # No member holds live state: rank 0 (each stage of replica 0 in a pipelined run)
            # restores the checkpoint, or everyone starts over from step 0, and the sync below
            # spreads its state.
            self._step_index = 0
            self._cursor = data_math.DataCursor(seed=self.data_config.seed)
            restorer = spec.rank < self.shape.size
            if spec.resume_from is not None and restorer:
                self._restore(spec.resume_from)
        holds_state = self._holds_state and not spec.restart
        held = self.techniques.before_sync(self._objects, {"step": self._step_index, "cursor": self._cursor.to_dict()},
                                           holds_state)
        self._rolled_back = held.rolled_back
        # A pipelined replica's stage syncs with the same stage of the other replicas only.
        self._last_sync, progress = sync_state(self._objects, held.progress, self.device, holds_state, data_group)
        if self.in_replicas:
            _check_stages_agree(progress["step"], self.device)
            source = dist.get_global_rank(data_group, self._last_sync.source_rank)
            self._last_sync = dataclasses.replace(self._last_sync, source_rank=source)
        if self._tensor is not None:
            self._share_random_state(groups["tp"])
        self._holds_state = True
        self._step_index = progress["step"]
        self._cursor = data_math.DataCursor(**progress["cursor"])
        self.techniques.after_sync(held, self._objects, progress, holds_state,
                                   spec.resume_from if spec.restart else None)
        if self._model is not None:
            self._model.ddp = self._wrap(self._model.module)
        if self._pipeline is not None:
            self._pipeline.bind(groups["pp"], self._average_over_replicas, self._all_averaged)
        # The hang check compares these across the members of one generation: count afresh.
        self._entered_sync = self._launched = 0
        done = time.perf_counter()
        return {"leave_s": started - left, "barrier_s": arrived - started, "connect_s": connected - arrived,
                "sync_s": done - connected}

    def _replica_groups(self, spec: GenerationSpec) -> dict[str, dist.ProcessGroup]:
        """This generation's groups of this worker, by the replicas' mesh dims: "dp" (the same place in every
        replica), and "pp" (its replica's pipeline) and "tp" (its stage's tensor-parallel group) where present."""
        self._position = self.shape.position(spec.rank)
        if (self._position.stage, self._position.tensor) != (self.pipeline_stage, self.tensor_parallel_rank):
            raise ElasticError(f"rank {spec.rank} of generation {spec.generation} is at {self._position} of its "
                               f"replica, but this worker holds slot {self._slot}: the controller must keep each "
                               "replica's workers in order; this is a bug in elastic")
        mesh = self.shape.mesh(spec.world_size, self.device.type)
        return {dim: mesh.get_group(dim) for dim in mesh.mesh_dim_names}

    def _share_random_state(self, group: dist.ProcessGroup) -> None:
        """Every worker of a tensor-parallel replica computes the model's whole (unplanned) parts alike, so
        they draw the same random numbers (dropout, say): the replica's rank 0 gives them its streams."""
        box = [self._random.state_dict() if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        self._random.load_state_dict(box[0])

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Load a durable checkpoint into this rank; the sync then spreads it to the others."""
        state = checkpoint.load_state(self._checkpoint_part)
        # Checkpoints written before the RNG states were synced resume with this rank's streams.
        missing = sorted(set(self._objects) - set(state) - {"progress", "rng"})
        if missing:
            raise CheckpointError(
                f"{checkpoint.path} holds no state for {missing} (it has {sorted(set(state) - {'progress'})}); "
                "register the same state as the run that wrote it, or use a new run name"
            )
        for name, obj in self._objects.items():
            if name not in state:
                continue
            try:
                load_into(obj, state[name])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"{checkpoint.path} does not fit the registered {name!r}: {exc}. Resume with the same "
                    "model and optimizer definition, or use a new run name"
                ) from exc
        self._step_index = state["progress"]["step"]
        self._cursor = data_math.DataCursor(**state["progress"]["cursor"])
        self.checkpoint = checkpoint

    def _wrap(self, module: torch.nn.Module) -> DistributedDataParallel | None:
        if self.techniques.replaces_ddp:
            return None  # local SGD: no gradient all-reduce
        ddp = DistributedDataParallel(
            module, device_ids=[self.device.index] if self.device.type == "cuda" else None, init_sync=False
        )
        self._hooked = (self._gradient_all_reduce.abortable or self.faults.needs_comm_hook
                        or self.techniques.hooks_gradients)
        if self._hooked:
            ddp.register_comm_hook(self, _allreduce_hook)
        return ddp

    def abort_stale_group(self, newer_generation: int) -> None:
        """Abort the collectives of a generation older than `newer_generation`, from the control
        thread: the train thread may wait in one of them for a peer that died or was cut off. On
        NCCL that is the communicator of the group captured when it formed, so the one replacing
        it is never hit; on gloo, the generation's gradient all-reduces (`GradientAllReduce`) and
        its connections (`GroupLinks.sever`), which fails any gloo call still waiting on a peer
        that sends nothing."""
        with self._group_lock:
            stale = self._group if self._group and self._group[0] < newer_generation else None
        collectives = self._gradient_all_reduce
        if collectives is not None and collectives.generation < newer_generation:
            collectives.abort(f"{PEER_ABORT_MARKER}: the controller offered generation {newer_generation} "
                              f"in place of {collectives.generation}, which lost a member")
        if stale is not None:
            _, group, links = stale
            abort_communicator(group)
            if self.spec is not None and self.spec.backend == "gloo":
                links.sever()

    def _enter_sync(self, step: Step) -> None:
        """The step's gradient-syncing backward starts: this rank's own compute is done.

        The count tells a hung rank from the peers waiting on it (they entered the sync it never
        reached), and the time is the rank's compute, free of waiting on slower peers.
        """
        self._entered_sync += 1
        if not self._hooked:
            self.techniques.count_unhooked_sync()
        if step.compute_s is None:
            step.compute_s = time.perf_counter() - step.started

    def progress(self) -> dict[str, Any]:
        """Where the train thread is, for the controller's hang check: answered from another thread."""
        return {"step": self._step_index, "entered_sync": self._entered_sync, "launched": self._launched,
                "arrived": self._arrived, "connected": self._connected, "checkpointing": self._waiting_on_checkpoint,
                "blocked_in": self._collective_in_progress()}

    def _collective_in_progress(self) -> str:
        """Where the train thread waits inside a torch.distributed call (a fact read from its
        stack, not a guess from messages), or "" when it does not."""
        frame = sys._current_frames().get(self._train_thread)
        called = None
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            # A pipeline schedule and DTensor run the model's compute too: of their own frames, only
            # a wait on peers counts (DTensor's collectives show in _functional_collectives' frames).
            waits = not module.startswith(COMPUTING) or frame.f_code.co_name in WAITS
            if module.startswith("torch.distributed") and waits:
                called = called or frame.f_code.co_name
            elif called is not None:
                code = frame.f_code
                return f"{called} called from {code.co_name} at {os.path.basename(code.co_filename)}:{frame.f_lineno}"
            frame = frame.f_back
        return ""

    def _claim(self, fault: Fault) -> bool:
        """Claim `fault` for this rank; True once per run, for the first rank to meet it."""
        store = self._store.get(self.spec.store_host, self.spec.store_port)
        if store.add(f"fault/{fault.spec()}", 1) != 1:
            return False
        self._on_fault(fault)
        return True

    def close(self) -> None:
        self._leave()
        if self._loader is not None:
            self._loader.close()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a state dict's tensor, gathered whole if it is a shard (a DTensor of ZeRO-2/3)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()  # a collective over the tensor's mesh
    return tensor.detach().to("cpu", copy=True)


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


def _allreduce_hook(ctx, bucket):
    """DDP's all-reduce, abortable on gloo (`GradientAllReduce`), compressed by the run's
    `GradientCompression` or `PowerSGD`, with the faults that act inside it, counting the
    buckets launched.

    Installed where the all-reduce must be abortable or compressed, and wherever such faults
    exist.
    Unannotated on purpose: DDP rejects a hook whose annotations are strings, which
    `from __future__ import annotations` would make them.
    """
    ctx.faults.at("allreduce", ctx.rank, ctx.step)
    future = ctx.techniques.codec.all_reduce(bucket, ctx._gradient_all_reduce.all_reduce)
    ctx._launched += 1
    return future


def _set_current(ctx: TrainContext | None) -> None:
    global _current
    _current = ctx
