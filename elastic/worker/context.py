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

import functools
import threading
import time
import types
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from elastic.checkpoint.checkpoint import Checkpoint, CheckpointWriter
from elastic.comm.collectives import Collectives
from elastic.comm.generation import collectives_landed, landing_failure, peer_failed
from elastic.comm.group import GenerationSpec
from elastic.comm.links import GroupLinks
from elastic.comm.state_sync import AwaitedState, RunState
from elastic.config import CheckpointConfig, DataConfig, Strategy
from elastic.data.loader import to_device
from elastic.errors import ElasticError
from elastic.faults import Fault
from elastic.parallel.prepared import WorkerPlace
from elastic.parallel.replicas import ReplicaCoordinates, ReplicaShape
from elastic.techniques.strategy import Techniques
from elastic.worker.batching import MicroBatching
from elastic.worker.data_parallel import ElasticDDP
from elastic.worker.injection import FaultInjector
from elastic.worker.loader_steps import EvaluationShards, LoaderSteps
from elastic.worker.mailbox import GenerationMailbox
from elastic.worker.membership import Membership, Progress
from elastic.worker.model_kinds import prepare
from elastic.worker.probe import HangProbe
from elastic.worker.random_state import RandomState
from elastic.worker.snapshots import Snapshots
from elastic.worker.step import BetweenSteps, Step
from elastic.worker.stepping import Stepping

_current: "TrainContext | None" = None


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


def prepare_model(model: torch.nn.Module, **options: Any) -> Any:
    """`get_context().prepare_model`, spelled as Ray Train's `ray.train.torch.prepare_model`."""
    return get_context().prepare_model(model, **options)


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`get_context().prepare_optimizer`: its `step()` commits the step."""
    return get_context().prepare_optimizer(optimizer)


def prepare_data_loader(loader: torch.utils.data.DataLoader) -> LoaderSteps | EvaluationShards:
    """`get_context().prepare_data_loader`, spelled as Ray Train's `ray.train.torch.prepare_data_loader`."""
    return get_context().prepare_data_loader(loader)


class TrainContext(ReplicaCoordinates):
    """Per-worker runtime of one run; created by the worker actor, reached via get_context().

    It holds the run's parts, each owning its state: the prepared model (one `PreparedModel`,
    whatever its kind), the `Membership` in generations, the `Snapshots` of checkpoints, the
    `MicroBatching` of each step's share, the `Stepping` that commits a step, and the `HangProbe`.
    Its coordinates in its replica (`ReplicaCoordinates`) come from its `shape` and `slot`.
    """

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
        warn: Callable[[str, str], None] = lambda kind, message: warnings.warn(message, stacklevel=3),
        max_workers: int = 1,
    ) -> None:
        self.data_config = data_config
        self._max_workers = max_workers  # ScalingConfig's: a prepared data loader's batch times it is the global batch
        self._warn_sink = warn  # (kind, message): the journal and the driver show it
        self._warned: set[str] = set()
        self.checkpoint_config = checkpoint_config
        self._latest_checkpoint = latest_checkpoint  # asks the controller
        self.mailbox = mailbox
        self.faults = FaultInjector(faults, lambda fault: self.membership.claim(fault, on_fault))
        self._report_sink = report_sink
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        self.strategy = strategy
        self.techniques = Techniques(strategy, self.device, data_config.max_steps, data_config.seed)
        self.shape = shape  # workers per replica; in a run of replicas the replica is the elastic unit
        self.slot = slot  # this worker's place in its replica, for its whole life
        self._random = RandomState()
        self._state = RunState(self._random)  # what a generation syncs and a checkpoint holds
        self._place = WorkerPlace(shape, slot, self.device, strategy)
        # The run's kind of prepared model, holding no model until prepare_model.
        self._prepared = prepare(self._place, self.techniques, None, self._state)
        self._progress = Progress(seed=data_config.seed)
        self.entered_steps = False  # whether the train loop iterated steps()
        self._steps_ended = False  # the run's last step committed here: final checkpoint and model taken
        # The generation in which steps() last offered a step (None: none yet).
        self._offered_in: int | None = None
        self._committed_here = False  # a step committed in this worker (one that joined as the run ended trained none)
        # Whether the data-parallel model prepare_model returned was called inside a step (None: no such model).
        self.model_called: bool | None = None
        self.loader_steps: LoaderSteps | None = None  # Ray Train's loop shape (`prepare_data_loader`)
        self._collectives: Collectives | None = None  # the train loop's, for the current generation
        self.probe = HangProbe(lambda: self._prepared.compute_frames)
        prepared = lambda: self._prepared  # noqa: E731  (prepare_model replaces it)
        self.membership = Membership(mailbox, place=self._place, state=self._state, progress=self._progress,
                                     model=prepared, techniques=self.techniques, faults=self.faults, probe=self.probe)
        self.snapshots = Snapshots(checkpoint_config, writer, state=self._state, progress=self._progress,
                                   membership=self.membership, model=prepared, techniques=self.techniques,
                                   faults=self.faults, latest_checkpoint=latest_checkpoint)
        self.batching = MicroBatching(data_config, shape, self.device, self.faults, self.techniques, self.probe,
                                      prepared)
        self.stepping = Stepping(self._progress, self.batching, self.techniques, self._random, self.faults,
                                 report_sink, self._warn)
        # What the worker's control thread calls.
        self.abort_stale_group = self.membership.abort_stale_group
        self.final_model: dict[str, torch.Tensor] | None = None  # rank 0's: the whole model once max_steps ran

    # --- what the train loop sees ------------------------------------------------------
    spec: GenerationSpec | None = property(lambda self: self.membership.spec)
    rank: int = property(lambda self: self.membership.rank)
    world_size: int = property(lambda self: self.membership.world_size)
    local_rank: int = property(lambda self: self.membership.spec.local_rank if self.membership.spec else -1)
    generation: int = property(lambda self: self.membership.generation)
    step: int = property(lambda self: self._progress.step, doc="Optimizer steps committed so far in the run.")
    num_replicas: int = property(lambda self: self.membership.num_replicas, doc="Replicas in the current "
                                 "generation: the data-parallel size (the world size where a replica is one worker).")
    replica_rank: int = property(lambda self: self.membership.replica_rank,
                                 doc="This worker's replica in the current generation: its data-parallel rank.")
    links: tuple[int, GroupLinks] | None = property(lambda self: self.membership.links, doc="The current "
                                                    "generation's number and its groups' connections; any thread.")
    checkpoint: Checkpoint | None = property(lambda self: self.membership.checkpoint,
                                             doc="The checkpoint this rank restored at a restart.")

    # Ray Train's names for the same (`ray.train.get_context()`).
    def get_world_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.membership.spec.local_world_size if self.membership.spec else -1

    def get_node_rank(self) -> int:
        return self.membership.spec.node_rank if self.membership.spec else -1

    def prepare_model(self, model: torch.nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                      | None = None, **options: Any) -> Any:
        """Register `model` for healing and wrap it in DDP; call before `steps()`.

        Under Strategy(zero=2 or 3) each generation shards it with FSDP2 instead: the returned
        module then holds that generation's sharded module (DTensor parameters) as `module`.
        In a run of replicas of several workers the returned model holds this worker's part of
        the replica's; `loss_fn` and the keyword `options` are that kind's, as the factory of
        prepared models lists them (`elastic.worker.model_kinds.prepare`). The kind of prepared
        model is picked there, once.
        """
        if self._prepared.returned is not None:
            raise ElasticError("prepare_model() was called twice; elastic syncs one model per run")
        self._prepared = prepare(self._place, self.techniques, model, self._state, loss_fn, **options)
        returned = self._prepared.returned
        if isinstance(returned, torch.nn.Module):  # the data-parallel kinds, which the loop calls itself
            self.stepping.model = returned
            self.model_called = False
            hook = None

            def called_in_a_step(*_: Any) -> None:
                if self.stepping.current is not None:
                    self.model_called = True
                    hook.remove()  # known now: no cost in later steps

            hook = returned.register_forward_pre_hook(called_in_a_step)
        if self.loader_steps is not None and isinstance(returned, torch.nn.Module):
            self._fit_to_loader_steps(returned)
        return returned

    def prepare_data_loader(self, loader: torch.utils.data.DataLoader) -> LoaderSteps | EvaluationShards:
        """Ray Train's loop shape (`elastic.worker.loader_steps`): iterate what this returns once per
        epoch; each batch is this rank's share of the next global step, which the prepared
        optimizer's `step()` commits, and a peer's death inside the backward heals in place. A
        second call prepares an evaluation's loader: each rank iterates its slice of it."""
        if self.loader_steps is not None:  # the training loader came first: this one is an evaluation's
            return EvaluationShards(loader, lambda: (max(self.rank, 0), max(self.world_size, 1)),
                                    lambda batch: to_device(batch, self.device))
        techniques = self.techniques
        kept = [name for name, used in (
            ("compression", techniques.hooks_gradients), ("local SGD or stale synchrony", techniques.acts_between_steps),
            ("ZeRO", self.strategy.zero > 0), ('precision="fp16"', techniques.precision.scaler is not None),
            ("replicas of several workers", self.shape.size > 1)) if used]
        if kept:
            raise ElasticError(f"Ray Train's loop shape (prepare_data_loader) runs plain DDP, with bf16 at most; "
                               f"this run uses {', '.join(kept)}: iterate ctx.steps(dataset) instead (docs/habits.md)")
        dataset = getattr(loader, "dataset", loader)
        self._take_data_config_from(loader)
        self.batching.whole_shares(self.data_config)
        self.loader_steps = LoaderSteps(lambda: self.steps(dataset), dataset, getattr(loader, "batch_size", None),
                                        self.data_config, lambda: self.stepping.optimizer is not None,
                                        self._loops_go_on, self._end_steps)
        self.membership.backward_failed = self._keep_failure_on_step
        self.membership.bucket_weight = self.loader_steps.gradient_weight
        if isinstance(self._prepared.returned, torch.nn.Module):
            self._fit_to_loader_steps(self._prepared.returned)
        if self.stepping.optimizer is not None:
            self.stepping.optimizer.register_step_pre_hook(self._nothing_to_step_if_failed)
        return self.loader_steps

    def _take_data_config_from(self, loader: Any) -> None:
        """What the DataConfig leaves unset, the loader says, as in Ray Train: the global batch is
        its batch size times the world size the run asks for (fixed whatever the world size: each
        rank's share grows when the world shrinks, and a newcomer's and a resumed run's are the
        same), and its sampler and drop_last say whether epochs are shuffled and a short last
        batch dropped."""
        config, taken = self.data_config, {}
        if config.global_batch_size is None:
            batch_size = getattr(loader, "batch_size", None)
            if not isinstance(batch_size, int):
                raise ElasticError(
                    f"the prepared data loader has no batch size ({type(loader).__name__}.batch_size = {batch_size!r}; "
                    "a batch_sampler sets none): give DataLoader(dataset, batch_size=N), or set "
                    "DataConfig(global_batch_size=...) on the trainer")
            taken["global_batch_size"] = batch_size * self._max_workers
        if "shuffle" not in config.model_fields_set and hasattr(loader, "sampler"):
            taken["shuffle"] = isinstance(loader.sampler, torch.utils.data.RandomSampler)
        if "drop_last" not in config.model_fields_set and hasattr(loader, "drop_last"):
            taken["drop_last"] = bool(loader.drop_last)
        self.data_config = config.model_copy(update=taken)

    def _prepare_when_stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """A global optimizer pre-hook, registered by `steps()` when no optimizer was prepared: the
        first optimizer that steps the model's parameters inside a step is prepared then, as Ray
        Train's loops prepare none. Unprepared, its state would not be synced to a newcomer, a heal
        would not agree that every rank averaged its gradients before any stepped, and a rolled-back
        step's gradients would stay in it. (A global hook is never removed while torch iterates the
        global hooks; past its first use it returns at once.)"""
        if self.stepping.optimizer is not None or self.stepping.current is None:
            return
        model = self._prepared.returned
        params = {id(p) for p in model.parameters()} if isinstance(model, torch.nn.Module) else set()
        if not any(id(p) in params for group in optimizer.param_groups for p in group["params"]):
            return
        strategy = self.techniques.strategy
        needs_it_first = ([f"precision={strategy.precision!r}"] if strategy.precision == "fp16" else []) + (
            [f"sync={strategy.sync!r}"] if strategy.sync != Strategy.model_fields["sync"].default else [])
        if needs_it_first:
            # fp16's scaler wraps the step (prepared at its first call, that call would step on scaled
            # gradients), and a periodic or stale sync keeps per-rank state of the optimizer from the
            # first formation on, which a newcomer without one would not take part in.
            raise ElasticError(f"Strategy({', '.join(needs_it_first)}) needs the optimizer prepared before the loop: "
                               "pass it through ctx.prepare_optimizer(optimizer) before ctx.steps() and step the one "
                               "it returns")
        if self.prepare_optimizer(optimizer) is not optimizer:
            raise ElasticError(f"this run's Strategy wraps the optimizer ({type(self.stepping.optimizer).__name__}): "
                               "pass it through ctx.prepare_optimizer(optimizer) before the loop and step the one "
                               "it returns")

    def _fit_to_loader_steps(self, model: torch.nn.Module) -> None:
        """In Ray Train's loop shape the prepared model weighs its outputs (`LoaderSteps.weigh`),
        and a peer's failure in its forward fails the step instead of the loop."""
        model.register_forward_hook(lambda module, args, output: self.loader_steps.weigh(output, module))
        if isinstance(model, ElasticDDP):
            model.forward_failed = self._keep_failure_on_step

    def _keep_failure_on_step(self, why: str) -> None:
        """Ray Train's loop shape: a peer's failure in DDP's forward or in the backward's all-reduce
        fails the current step instead of raising into the loop; the next batch heals."""
        step = self.stepping.current
        if step is not None and step.failed is None:
            step.failed = why

    def _gradients_landed(self, *_: Any) -> None:
        """Wait for the step's collectives to land before the optimizer steps (`collectives_landed`).
        In Ray Train's loop shape gradients that did not land fail the step, as a failed all-reduce
        does, instead of raising into the loop."""
        if self.loader_steps is None:
            collectives_landed()
            return
        current = self.stepping.current
        if current is not None and current.failed is not None:
            return  # failed already: nothing will step
        failure = landing_failure()
        if failure is not None:
            self._keep_failure_on_step(f"{type(failure).__name__}: {failure}")

    def _nothing_to_step_if_failed(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """In Ray Train's loop shape the loop steps the optimizer after a failed backward too: with
        no gradients torch's optimizers leave every parameter and state as it is (and the step
        does not commit), and the next batch heals."""
        current = self.stepping.current
        if current is not None and current.failed is not None:
            optimizer.zero_grad(set_to_none=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register `optimizer` for healing; its `step()` commits the current global step.

        Step the optimizer this returns: under Strategy(zero=1) it is a `ShardedOptimizer`
        around yours, whose state is sharded across the ranks rather than synced whole; under
        zero=2 or 3 a `ShardedParamsOptimizer` stepping your optimizer's class over the shards.
        """
        if self.stepping.optimizer is not None:
            raise ElasticError("prepare_optimizer() was called twice; elastic syncs one optimizer per run")
        optimizer = self.stepping.optimizer = self.techniques.prepare_optimizer(optimizer, self._state)
        techniques = self.techniques
        if self.membership.device.type == "cuda" and not (techniques.lands_in_step or techniques.lands_own_sums):
            # First of the hooks: on NCCL the step's gradients may still wait on a dead peer
            # (`elastic.comm.generation`); a failure raises here, before anything steps. ZeRO-2/3 and
            # fp16 wait inside their step, local SGD and stale synchrony where they apply their sums.
            optimizer.register_step_pre_hook(self._gradients_landed)
        optimizer.register_step_pre_hook(lambda *_: self.batching.check_weighted(self.stepping.current))
        self._prepared.prepare_optimizer(optimizer, self._state, lambda: self.stepping.current)
        self.techniques.hook_optimizer(optimizer, lambda: (self.step, self.world_size), self.membership.launch_average)
        self._tell_calls(optimizer)
        optimizer.register_step_post_hook(lambda *_: self.stepping.commit())
        if self.loader_steps is not None:
            optimizer.register_step_pre_hook(self._nothing_to_step_if_failed)
        return optimizer

    def _tell_calls(self, optimizer: torch.optim.Optimizer) -> None:
        """Tell the stepping of each call to `optimizer.step()`, which a pre-hook would miss where
        the call steps nothing (fp16's scaler skips the inner step on an overflow). A bound method,
        as the optimizer's own: LR schedulers wrap `optimizer.step.__func__`."""
        called, stepping = optimizer.step, self.stepping

        @functools.wraps(called)
        def step(bound: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if stepping.current is not None:  # (whether or not it steps: fp16's scaler may skip it)
                stepping.current.optimizer_called = True
            return called(*args, **kwargs)

        optimizer.step = types.MethodType(step, optimizer)

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
        if self.stepping.inside_step:
            raise ElasticError("ctx.between_steps() is used inside `with step`, which heals a peer's death itself "
                               "(and must not move to a new generation halfway through a step); use it outside the step")
        if self.spec is None:
            raise ElasticError("ctx.between_steps() is used before ctx.steps() formed the first generation")
        # The loop runs the block again in the healed generation, which a newcomer could not.
        return BetweenSteps(lambda: self._join(reason="heal", in_block=True))

    @property
    def communication(self) -> dict[str, int]:
        """What this rank sent to keep the replicas in step so far: `sync_bytes` handed to DDP's
        gradient all-reduce (after compression) or to local SGD's syncs, `outer_syncs`, and
        `hierarchical_all_reduces`, the all-reduces summed within each node first (`Strategy(all_reduce)`)."""
        return {**self.techniques.communication(self.probe.unhooked_syncs),
                "hierarchical_all_reduces": self.membership.hierarchical_all_reduces}

    def synced_state(self) -> dict[str, Any]:
        """The state of everything a heal or a grow syncs (model, optimizer, registered state,
        the technique's), by name: the same on every rank of a generation."""
        return self._state.states()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole prepared model's state dict, on the CPU, on every rank: in any layout, the
        same names and tensors as the model given to `prepare_model`.

        A collective, as torch's own full-state-dict helpers are: call it on every rank at the
        same point of the loop. ZeRO-2/3's parameter shards are gathered (every rank takes part
        in each gather), and a replica's parts joined, each kind its own way (`whole_state_dict`).
        """
        if self._state.model is None:
            raise ElasticError("ctx.model_state_dict() gives the prepared model's state: call ctx.prepare_model(model) "
                               "first")
        return self._prepared.whole_state_dict()

    def register_state(self, name: str, obj: Any) -> None:
        """Sync another stateful object (a tensor, or anything with state_dict/load_state_dict)."""
        self._state.register(name, obj)

    def add_checkpoint_file(self, name: str, data: bytes) -> None:
        """Store `data` as file `name` in every checkpoint from now on; read it with Checkpoint.read_file."""
        self.snapshots.add_file(name, data)

    def set_checkpoint_metadata(self, **metadata: Any) -> None:
        """JSON-able values stored in the manifest of every checkpoint from now on."""
        self.snapshots.set_metadata(**metadata)

    def _warn(self, kind: str, message: str) -> None:
        """Tell the train loop's misuse once per kind (see docs/habits.md)."""
        if kind not in self._warned:
            self._warned.add(kind)
            self._warn_sink(kind, message)

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        if checkpoint is not None:
            self.snapshots.report(checkpoint, self.rank)  # refused before the first step
        if self.stepping.current is None and not (self.loader_steps is not None and self.entered_steps):
            # (In Ray Train's loop shape a report after the last epoch is the last step's.)
            where = "after ctx.steps() ended" if self.entered_steps else "before ctx.steps() began"
            self._warn("report_outside_step",
                       f"elastic.report({sorted(metrics)}) was called on rank {self.rank} {where}: its metrics belong "
                       "to no step and were dropped. Report inside the `for step in ctx.steps(...)` loop, after "
                       "`with step:` (Result.metrics then holds the last step's).")
            return
        # A tensor is made a number on the report thread (`plain_metrics`); detached, it holds no graph until then.
        metrics = {k: v.detach() if type(v) is torch.Tensor else v for k, v in metrics.items()}
        self._report_sink(
            {"kind": "metrics", "step": self.step, "rank": self.rank, "time": time.time(), "metrics": metrics}
        )

    def get_checkpoint(self) -> Checkpoint | None:
        """See `elastic.get_checkpoint`."""
        latest = self._latest_checkpoint()
        return latest if latest is not None and latest.reported_files() else None

    def steps(self, dataset: Any) -> Iterator[Step]:
        """Yield each remaining global step of the run, healing and rescaling in between."""
        if self._steps_ended:
            return  # a loop that calls ctx.steps() once per epoch: the run's steps are over
        if self.entered_steps:
            # Its join would wait for a generation that never comes: the other members are past it.
            raise ElasticError(
                "ctx.steps(dataset) was called again while the run's steps go on (the loop over the first call "
                "left early): it is iterated once per run, through every epoch up to DataConfig(max_steps) "
                "(`step.cursor.epoch` says which epoch a step is in). Iterate one call to its end; to stop "
                "sooner, lower max_steps")
        max_steps = self.data_config.max_steps
        if self.loader_steps is None and None in (self.data_config.global_batch_size, max_steps):
            raise ElasticError(
                f"ctx.steps(dataset) needs DataConfig(global_batch_size=..., max_steps=...) on the trainer (given: "
                f"global_batch_size={self.data_config.global_batch_size}, max_steps={max_steps}): it serves each rank "
                "its share of a fixed global batch and ends at max_steps. A loop over elastic.prepare_data_loader(loader) "
                "needs neither, as in Ray Train (docs/habits.md)")
        loader = self.batching.open(dataset, self._state)
        self.entered_steps = True
        self.probe.train_thread = threading.get_ident()
        if self.stepping.optimizer is None:
            register_optimizer_step_pre_hook(self._prepare_when_stepped)
            # What the join syncs (or restores) for it waits until then: a newcomer's optimizer
            # takes its peers' momentum, a resumed run's its checkpoint's.
            self._state.optimizer = AwaitedState()
        self._join(reason="start")
        # The steady path runs this loop's body once a step, right after the step's compute has
        # pushed it out of the caches: every call in it costs several times its warm cost.
        progress, mailbox, membership, snapshots = self._progress, self.mailbox, self.membership, self.snapshots
        techniques, faults, random_state, stepping = self.techniques, self.faults, self._random, self.stepping
        heal_in_check = lambda: self._join(reason="heal", lost=0)  # noqa: E731
        acts_between_steps = techniques.acts_between_steps  # settled by prepare_model, before the steps
        checkpointing = snapshots.config.enabled  # without a schedule, nothing to check between steps
        while max_steps is None or progress.step < max_steps:
            # A checkpoint averages per-rank state first (PowerSGD's, local SGD's): a peer's death in it heals.
            if checkpointing and snapshots.read_flag(heal=heal_in_check) and not self._healed_unless(snapshots.take):
                continue
            spec = membership.spec  # the generation this rank is in, formed by the join above
            if mailbox.at_boundary(progress.step, spec.generation) is not None:
                if self._healed_unless(techniques.drain):
                    self._join(reason="rescale")
                continue
            if faults.armed:
                faults.at("step_start", spec.rank, progress.step, stepping.compute_s)
            random_state.mark()
            progress.cursor = loader.settle(progress.cursor)
            step = Step(self, spec, progress.step, progress.cursor, loader.step_samples(progress.cursor))
            stepping.current = step
            self._offered_in = spec.generation
            yield step
            stepping.current = None
            if not step.entered:
                if membership.spec is not spec:
                    continue  # healed before it was entered (`LoaderSteps`' agreement): offered again
                raise ElasticError("each step from ctx.steps() must be used as `with step:`")
            self._committed_here = self._committed_here or step.committed
            if step.failed is not None:
                # Unless the loop healed meanwhile: it ran collectives after the step (an evaluation
                # in `ctx.between_steps()`), which failed on the same death and healed already.
                if membership.spec is spec:
                    self._join(reason="heal", lost=0 if step.committed else 1)
                continue
            if acts_between_steps:
                if techniques.sync_due(progress.step) and not self._healed_unless(
                        lambda: techniques.outer_sync(self._state, progress.to_dict())):
                    continue
                techniques.at_boundary(self._state, progress)
            if checkpointing:
                self._healed_unless(lambda: snapshots.after_step(max_steps))
        self._end_steps()

    def end_loop(self) -> None:
        """The train loop returned. A loop over a prepared data loader ends the run's steps here:
        the run has no max_steps, or the loop ran fewer epochs than max_steps holds."""
        if self.loader_steps is None or not self.entered_steps or self._steps_ended:
            return
        self.loader_steps.close()  # ends the run's steps for every member where an epoch starts
        if not self._steps_ended:
            self._end_steps()

    def _loops_go_on(self, going_on: bool) -> bool | None:
        """Whether every member's loop over the prepared data loader goes on to the epoch that
        starts (`LoaderSteps`); None if a peer died in the agreement, and this rank healed."""
        flag = torch.full((1,), int(going_on), dtype=torch.int64, device=self.device)
        # A newcomer begins its pass with this agreement, so it may join the heal (`LoaderSteps`).
        with BetweenSteps(lambda: self._join(reason="heal")) as block:  # which waits for the MIN to land on NCCL
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return None if block.failed else bool(flag.item())

    def _end_steps(self) -> None:
        """After the run's last step: the final checkpoint and the whole model, the loader closed."""
        self._steps_ended = True
        self.stepping.current = None
        self.snapshots.drop_flag()
        # Every member of the run's last generation writes a shard of its final checkpoint, so each
        # decides from facts they all share: steps were offered in this generation, or it formed
        # around members that trained (a newcomer that joined as the last step committed, which
        # was offered none). A run resumed at its end has neither, and writes none.
        if self._offered_in == self.membership.generation or self.membership.continues_training:
            self.snapshots.final()
        self._keep_final_model()
        self.batching.loader.close()
        with self.probe.waiting_on_checkpoint():  # the hang check counts the uploads' wait as progress
            self.snapshots.wait_for_writer()
        if self.model_called is False and self._committed_here:
            self._warn("model_never_trained",
                       f"the model prepare_model() returned was never called inside a step on rank {self.rank}: "
                       "its parameters were not trained, and what was trained is not synced nor checkpointed. "
                       "Call the model prepare_model() returned (not the module you passed it) inside `with step:`.")

    def _keep_final_model(self) -> None:
        """Once the last step committed, rank 0 keeps the whole model (`Result.model_state_dict()`)."""
        if self._state.model is None:
            return
        try:
            whole = self.model_state_dict()
            collectives_landed()  # ZeRO's gathers of the shards, on NCCL only queued
        except Exception as exc:
            if not peer_failed(exc):
                raise
            return  # a peer died at the very end: the Result says there is no whole model, and why
        if self.rank == 0:
            self.final_model = whole

    def _healed_unless(self, collective: Callable[[], None]) -> bool:
        """Run a technique's collective between steps (local SGD's sync, stale synchrony's wait
        before a switch); False if a peer died in it, which this rank healed."""
        try:
            collective()
        except Exception as exc:
            if not peer_failed(exc):
                raise
            self._join(reason="heal")
            return False
        return True

    def _join(self, reason: str, lost: int = 0, in_block: bool = False) -> None:
        self.snapshots.drop_flag()  # a pending check belongs to the group being left
        self.membership.join(reason, lost, in_block)

    def probe_reading(self) -> dict[str, Any]:
        """Where the train thread is, for the controller's hang check: answered from another thread."""
        return self.probe.reading(self.step)

    def close(self) -> None:
        self.snapshots.drop_flag()
        self.membership.leave()
        if self.batching.loader is not None:
            self.batching.loader.close()


def _set_current(ctx: TrainContext | None) -> None:
    global _current
    _current = ctx
