"""`ElasticTrainer`, the driver's entry point, and the `Result` of a run.

    trainer = ElasticTrainer(train_loop, train_loop_config={...},
                             scaling_config=ScalingConfig(min_workers=2, max_workers=4),
                             run_config=RunConfig(name="lm", storage_path="/tmp/runs"),
                             data_config=DataConfig(global_batch_size=64, micro_batch_size=32, max_steps=100))
    result = trainer.fit()

`fit()` validates everything it can before any actor starts, connects to Ray as `ray.init`
does (the given address, else RAY_ADDRESS, else a Ray already started on this machine with
`ray start`, else a new local instance), starts the run's controller actor on
the head node, shows progress while the run goes on, and returns a `Result` or raises.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
import torch

from elastic.checkpoint.checkpoint import Checkpoint, check_resume_keeps_history, latest_complete
from elastic.checkpoint.storage import RunStorage
from elastic.config import (DataConfig, RunConfig, ScalingConfig, Strategy, check_devices_fit, check_fits,
                            check_replicas_fit, check_strategy_fits)
from elastic.data.loader import check_resumed_order
from elastic.errors import CapacityTimeoutError, ElasticError, TrainingFailedError
from elastic.faults import Fault, check_faults
from elastic.journal.display import ProgressDisplay
from elastic.parallel.parts import check_resume_fits
from elastic.parallel.replicas import ReplicaShape

STATUS_POLL_S = 0.5
HEAD_NODE_RESOURCE = "node:__internal_head__"


@dataclass
class Result:
    """What a finished run leaves: final metrics, step, goodput, rank 0's return value, events."""

    metrics: dict[str, Any]
    step: int
    goodput: float
    value: Any
    path: str
    checkpoint: Checkpoint | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    final_model: dict[str, torch.Tensor] | None = None

    def events_of(self, type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type]

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole trained model's state dict as of the run's last step, in any layout (DDP,
        ZeRO-1/2/3, replicas of several workers): the names and shapes of the model given to
        `ctx.prepare_model`, on the CPU. With or without a checkpoint schedule."""
        if self.final_model is None:
            raise ElasticError(
                "this run left no whole model: its train loop prepared none (ctx.prepare_model), left ctx.steps() "
                "before max_steps, or a worker died as the model was gathered at the end; load a checkpoint's "
                "instead: result.checkpoint.model_state_dict(), with CheckpointConfig(every_steps=N)")
        return self.final_model


class ElasticTrainer:
    def __init__(
        self,
        train_loop: Callable,
        *,
        scaling_config: ScalingConfig,
        run_config: RunConfig,
        data_config: DataConfig | None = None,
        train_loop_config: dict[str, Any] | None = None,
        strategy: Strategy | None = None,
        faults: list[Fault] | None = None,
        resume_from: str | Checkpoint | None = None,
        address: str | None = None,
        show_progress: bool = True,
    ) -> None:
        # Without one, a loop over a prepared data loader takes its global batch from the loader and
        # ends where it returns, as in Ray Train; ctx.steps(dataset) says what it needs.
        data_config = data_config or DataConfig()
        check_fits(scaling_config, data_config)
        self.faults = list(faults or [])
        check_faults(self.faults, data_config.max_steps, scaling_config.max_workers)
        # Everything below travels to the controller and the workers by pickle; Ray's own error
        # would dump the whole RunSpec, so name the argument (or the key) that cannot travel.
        _check_travels(train_loop, "train_loop", "define it at module level and keep unpicklable objects "
                       "(locks, open files, sockets) out of its closure")
        self.train_loop_config = dict(train_loop_config or {})
        _check_travels(self.train_loop_config, "train_loop_config", "pass plain values (numbers, strings, paths, "
                       "tensors) and create locks, open files, sockets and clients inside train_loop")
        _check_travels(self.faults, "faults", 'pass elastic.Fault objects, e.g. Fault(kind="kill", rank=1, step=20)')
        _check_travels(resume_from, "resume_from", "pass the checkpoint's path as a str, or a Checkpoint on a "
                       "filesystem that pickles (pyarrow's built-in ones do)", round_trip=True)
        _check_travels(run_config.storage_filesystem, "storage_filesystem", "every worker gets a copy: use one of "
                       "pyarrow's filesystems (e.g. pyarrow.fs.S3FileSystem(...)), or leave it None and give "
                       "storage_path as a URI", round_trip=True)
        self.resume_from = resume_from
        self.train_loop = train_loop
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.data_config = data_config
        self.strategy = strategy or Strategy()
        check_strategy_fits(self.strategy, run_config.checkpoint_config)
        check_replicas_fit(scaling_config, data_config, self.strategy)
        check_devices_fit(scaling_config, self.strategy)
        _check_faults_fire(self.faults, self.strategy)
        self.address = address or os.environ.get("RAY_ADDRESS")
        self.show_progress = show_progress

    def fit(self) -> Result:
        self.run_config = located(self.run_config)
        storage = RunStorage(self.run_config.storage_path, self.run_config.name, self.run_config.storage_filesystem)
        storage.check_writable()
        resume_from = self.resume_from
        if isinstance(resume_from, str):
            resume_from = Checkpoint.from_path(resume_from, self.run_config.storage_filesystem)
        if resume_from is not None:
            check_resume_keeps_history(storage, resume_from)
        # The controller resumes from resume_from, else from the run's own latest checkpoint.
        resumes = resume_from or latest_complete(storage, lambda step, reason: None)
        if resumes is not None:
            max_steps = self.data_config.max_steps
            if max_steps is not None and resumes.step > max_steps:
                raise ElasticError(
                    f"the run resumes from {resumes.path}, at step {resumes.step}, past DataConfig(max_steps={max_steps}): "
                    f"there is nothing to train. Give max_steps above {resumes.step} to train further, or a new "
                    "RunConfig(name=...) to start afresh")
            check_resume_fits(resumes, ReplicaShape.of(self.scaling_config))
            check_resumed_order(resumes.cursor, self.data_config, resumes.path)
        if not ray.is_initialized():
            ray.init(address=self.address)
        self._check_cluster_can_host_min_workers()

        from actors.controller import Controller, RunSpec

        spec = RunSpec(self.train_loop, self.train_loop_config, self.scaling_config, self.run_config,
                       self.data_config, self.strategy, self.faults, resume_from)
        # The head node lives as long as the cluster does; worker nodes may be preempted.
        controller = Controller.options(
            resources={HEAD_NODE_RESOURCE: 0.001},
            # If the controller dies, Ray restarts it and re-runs `run`, which resumes from storage.
            max_restarts=-1,
            max_task_retries=-1,
            name=f"elastic-controller-{self.run_config.name}",
            get_if_exists=False,
        ).remote(spec)
        run_ref = controller.run.remote()
        line = ProgressDisplay() if self.show_progress else None
        try:
            while not ray.wait([run_ref], timeout=STATUS_POLL_S)[0]:
                if line:
                    status_ref = controller.status.remote()
                    # While Ray restarts a dead controller, status waits; the line just pauses.
                    if ray.wait([status_ref, run_ref], timeout=STATUS_POLL_S * 4)[0] == [status_ref]:
                        line.show(ray.get(status_ref))
            if line:
                line.show(ray.get(controller.status.remote()))  # the final state, e.g. step 80/80
        finally:
            if line:
                line.close()
        outcome = ray.get(run_ref)
        ray.kill(controller)
        # This attempt's events, from the controller's memory: a store that is away does not hide them.
        events = outcome["events"]
        if outcome["journal_error"]:
            warnings.warn(f"{outcome['journal_error']}; Result.events holds them", stacklevel=2)
        for warning in (e for e in events if e["type"] == "warning"):
            by = "" if warning["worker_id"] is None else f"worker {warning['worker_id']}: "
            warnings.warn(by + warning["message"], stacklevel=2)
        if not outcome["finished"]:
            failure = outcome["failure"]
            if failure.get("kind") == "capacity":
                raise CapacityTimeoutError(failure["error"])
            raise TrainingFailedError(
                f"run {self.run_config.name!r} failed on rank {failure.get('rank')}: {failure['error']}",
                rank=failure.get("rank"),
                traceback=failure.get("traceback", ""),
            )
        return Result(outcome["metrics"], outcome["step"], outcome["goodput"], outcome["value"], storage.uri,
                      outcome["checkpoint"], events, outcome["model"])

    def _check_cluster_can_host_min_workers(self) -> None:
        """Fail before starting anything when the cluster could never host min_workers."""
        per_worker = self.scaling_config.worker_resources()
        total = ray.cluster_resources()
        for resource, amount in per_worker.items():
            if amount <= 0:
                continue
            fits = int(total.get(resource, 0) // amount)
            if fits < self.scaling_config.min_workers and not _autoscaling():
                raise ElasticError(
                    f"the cluster has {resource}={total.get(resource, 0):g} in all, enough for {fits} workers of "
                    f"{per_worker}, but ScalingConfig(min_workers={self.scaling_config.min_workers}); lower "
                    "min_workers or resources_per_worker, or add nodes"
                )


def located(run_config: RunConfig) -> RunConfig:
    """`run_config` with a local storage_path made absolute where the driver stands: the controller
    and the workers resolve it in their own working directory (on another node, under `ray start`,
    the folder it was started in), and would write the run somewhere the driver never looks."""
    path = run_config.storage_path
    if run_config.storage_filesystem is not None or "://" in path or os.path.isabs(path):
        return run_config
    return run_config.model_copy(update={"storage_path": os.path.abspath(os.path.expanduser(path))})


def _check_faults_fire(faults: list[Fault], strategy: Strategy) -> None:
    """Faults that act inside DDP's gradient all-reduce never fire where no DDP runs."""
    replaced = (f"zero={strategy.zero}" if strategy.zero >= 2 else
                f"sync={strategy.sync!r}" if strategy.sync_options["kind"] != "ddp" else None)
    inside = [f.spec() for f in faults if f.point == "allreduce"]
    if replaced and inside:
        raise ElasticError(f"faults {inside} act inside DDP's gradient all-reduce, which {replaced} does not run "
                           "(it syncs another way), so they would never fire; inject them at the step start "
                           "(drop where=allreduce; a hang has no other point)")


def _check_travels(value: Any, where: str, fix: str, round_trip: bool = False) -> None:
    """Raise ElasticError naming the part of `value` that cannot be pickled (or, with round_trip, unpickled)."""
    found = _unpicklable_part(value, where)
    if found:
        part, exc = found
        raise ElasticError(f"{part} cannot be pickled ({type(exc).__name__}: {exc}); {fix}") from exc
    if round_trip:
        try:
            ray.cloudpickle.loads(ray.cloudpickle.dumps(value))
        except Exception as exc:
            raise ElasticError(f"{where} pickles but cannot be unpickled ({type(exc).__name__}: {exc}); {fix}") from exc


def _unpicklable_part(value: Any, where: str) -> tuple[str, Exception] | None:
    """The innermost dict key or list item, as `where['key'][0]`, that does not pickle, with its error."""
    try:
        ray.cloudpickle.dumps(value)
        return None
    except Exception as exc:
        if isinstance(value, dict):
            parts = [(f"{where}[{key!r}]", item) for key, item in value.items()]
        elif isinstance(value, (list, tuple)):
            parts = [(f"{where}[{i}]", item) for i, item in enumerate(value)]
        else:
            parts = []
        for part, item in parts:
            found = _unpicklable_part(item, part)
            if found:
                return found
        return where, exc


def _autoscaling() -> bool:
    """An autoscaling cluster may add nodes later, so its current size is not a limit."""
    return os.environ.get("ELASTIC_CLUSTER_AUTOSCALES", "") == "1"
