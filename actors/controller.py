"""The controller actor: one per run. It hosts the rendezvous store and carries out the protocol.

Every decision lives in `elastic.controller.protocol`. This actor only turns what Ray tells it into
observations (a worker is ready, its `run` call ended or failed, its group broke, it formed a
generation) and carries out the actions the protocol returns: start workers, prepare, offer
or abort a generation, kill a worker, read the members' hang probes, journal an event. Observations queue on
one asyncio inbox, so the protocol sees them one at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
import torch.distributed as dist
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeLabelSchedulingStrategy, NotIn, PlacementGroupSchedulingStrategy

from actors.metrics import RunMetrics
from actors.worker import Worker
from elastic.checkpoint.checkpoint import Checkpoint, latest_complete
from elastic.checkpoint.shards import ShardCollector
from elastic.checkpoint.storage import RunStorage
from elastic.comm.group import GenerationSpec, abort_generation, forget_generation
from elastic.config import DataConfig, RunConfig, ScalingConfig, Strategy
from elastic.controller import policies, signals
from elastic.controller.detectors import StragglerCheck
from elastic.controller.tally import RunTally
from elastic.controller.protocol import Protocol
from elastic.controller.states import Failed, Formation
from elastic.faults import Fault
from elastic.journal.events import EventJournal, read_events
from elastic.journal.resume import resume
from elastic.parallel.replicas import ReplicaShape
from elastic.worker.injection import die

NODE_ID_LABEL = "ray.io/node-id"  # a label Ray gives every node
TICK_S = 0.5


@dataclass
class RunSpec:
    """What the driver hands to the controller."""

    train_loop: Callable
    train_loop_config: dict[str, Any]
    scaling: ScalingConfig
    run: RunConfig
    data: DataConfig
    strategy: Strategy
    faults: list[Fault] = field(default_factory=list)
    resume_from: Checkpoint | None = None
    attempt: str = field(default_factory=lambda: uuid.uuid4().hex)


@ray.remote(num_cpus=0)
class Controller:
    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.storage = RunStorage(spec.run.storage_path, spec.run.name, spec.run.storage_filesystem)
        # A resumed run, or this controller restarted by Ray, continues the run's journal.
        self.journal = EventJournal(self.storage, read_events(self.storage))
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        self.store_host = ray.util.get_node_ip_address()
        # Forgetting a generation is a delete per member: one thread and a connection of its own,
        # so that neither the event loop nor an abort on `store` waits behind them.
        self.forgetting = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-forget")
        self.forget_store = dist.TCPStore("127.0.0.1", self.store.port, is_master=False, wait_for_workers=False)
        # Ray re-runs __init__ when it restarts a dead controller: the journal says whether this
        # attempt ran before, and what it continues.
        resumed = resume(self.journal.events, spec.attempt)
        self.restarted = resumed.restarted
        for fault in resumed.fired:
            self.store.add(f"fault/{fault}", 1)  # a fault fires once per attempt, across restarts
        self.protocol = Protocol(
            spec.scaling, spec.run.failure_config, spec.data.max_steps,
            switch_every=spec.strategy.sync_options.get("every", 1),
            generation=resumed.generation, failures=resumed.failures,
        )
        self.handles: dict[int, Any] = {}
        self.starting: set[asyncio.Future] = set()  # worker creations under way (`_start_workers`)
        self.kill_when_created: set[int] = set()  # workers killed before their actor existed
        self.start_error: BaseException | None = None
        self.refused: set[tuple[int, str]] = set()  # (worker, kind) already journaled as fenced
        self.warned: set[str] = set()  # kinds of `warning` journaled
        self.placement_groups: dict[int, PlacementGroup] = {}  # by replica, in a run of replicas
        self.avoided: set[str] = set()
        self.metrics = RunMetrics(spec.run.name)
        self.tally = RunTally(spec.data.max_steps)
        self.latest_checkpoint: Checkpoint | None = None
        # (generation, step) of the last restart offered: retention keeps its checkpoint until it formed.
        self.restoring: tuple[int, int] | None = None
        self.shards = ShardCollector(self.storage, spec.run.checkpoint_config.keep_last, spec.attempt)
        self.unsaved: dict[int, str] = {}  # checkpoints skipped, by step: why
        # Manifests and retention deletes, one at a time and in order, on a thread of their own:
        # a store that stalls holds only them, never the event loop nor the threads it shares.
        self.manifests = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-manifest")
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.loop_ref = None
        self.started = time.time()

    # --- called by the driver ----------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        if self.restarted:
            self.journal.emit("controller_restarted", reason="the controller actor died and Ray restarted it",
                              generation=self.protocol.generation, failures=self.protocol.failures)
        self.journal.emit("run_started", name=self.spec.run.name, attempt=self.spec.attempt,
                          scaling=self.spec.scaling.model_dump(),
                          data=self.spec.data.model_dump(), strategy=self.spec.strategy.model_dump(),
                          faults=[f.spec() for f in self.spec.faults])
        # The run folder is this attempt's from now on: workers check they see it (`check_shared`),
        # and the controller of another attempt still running writes no manifest into it.
        if self.spec.run.checkpoint_config.enabled:
            await asyncio.to_thread(self.storage.take, self.spec.attempt)
        self.latest_checkpoint = await asyncio.to_thread(self._resumes_from)
        if self.latest_checkpoint is not None:
            self.tally.resumed_at(self.latest_checkpoint.step)
            self.journal.emit("run_resumed", step=self.latest_checkpoint.step, checkpoint=self.latest_checkpoint.path)
        self.loop_ref = ray.put(self.spec.train_loop)
        await self._execute(self.protocol.start(time.time()))
        ticker = asyncio.ensure_future(self._tick())
        try:
            while not self.protocol.finished and not isinstance(self.protocol.state, Failed):
                # Every observation that queued meanwhile, as one batch (`signals.coalesce`).
                batch = [await self.inbox.get()]
                while not self.inbox.empty():
                    batch.append(self.inbox.get_nowait())
                actions = [action for observation in batch
                           for action in self.protocol.step(observation, time.time())]
                await self._execute(signals.coalesce(actions))
                if self.start_error is not None:
                    raise self.start_error
        finally:
            ticker.cancel()
            await self._stop_all()
        return self._result()

    def _resumes_from(self) -> Checkpoint | None:
        """A restarted controller takes the newest checkpoint its attempt completed; else the
        attempt starts where its first controller did: resume_from, or the run's newest. Not the
        newest on disk: past a `resume_from` of an older step, the newer ones are another history."""
        def skipped(step: int, reason: str) -> None:
            self.journal.emit("checkpoint_skipped", step=step, reason=reason)
        own = latest_complete(self.storage, skipped, attempt=self.spec.attempt) if self.restarted else None
        return own or self.spec.resume_from or latest_complete(self.storage, skipped)

    async def status(self) -> dict[str, Any]:
        events = self.journal.events
        return {
            "state": self.protocol.state.name,
            **self.tally.snapshot(),
            "world_size": len(self.protocol.members),
            "generation": self.protocol.running,
            "last_event": events[-1]["type"] if events else "",
        }

    # --- called by workers ---------------------------------------------------------------
    async def worker_ready(self, worker_id: int, info: dict[str, Any]) -> None:
        self.inbox.put_nowait(signals.WorkerReady(worker_id, info["node_id"], info["pid"], info["host"], info["binds"]))

    async def group_broken(self, worker_id: int, generation: int) -> None:
        self.inbox.put_nowait(signals.GroupBroken(worker_id, generation))

    async def formed(self, worker_id: int, generation: int, outcome: dict[str, Any]) -> None:
        timings = {k: outcome[k] for k in ("leave_s", "barrier_s", "connect_s", "sync_s") if k in outcome}
        self.inbox.put_nowait(signals.FormedReport(
            worker_id, generation, outcome["ok"], outcome.get("step", 0), outcome.get("source_rank", 0),
            outcome.get("steps_lost", 0), outcome.get("error", ""), timings, outcome.get("state_lost", False),
            checkpointed=self.latest_checkpoint is not None, in_block=outcome.get("in_block", False)))

    async def ingest(self, worker_id: int, items: list[dict[str, Any]]) -> None:
        if self._fenced(worker_id, "reports"):
            return
        self.tally.ingest(worker_id, items)
        self.inbox.put_nowait(signals.StepCommitted(self.tally.reported_step))

    async def warn(self, worker_id: int, kind: str, message: str) -> None:
        """A worker saw the train loop misuse the API (`TrainContext`): journaled once per kind; the driver warns."""
        if kind not in self.warned:
            self.warned.add(kind)
            self.journal.emit("warning", worker_id=worker_id, kind=kind, message=message)

    async def latest_checkpoint_of_run(self) -> Checkpoint | None:
        """The newest complete checkpoint: the one a restart resumes from (elastic.get_checkpoint)."""
        return self.latest_checkpoint

    async def fault_fired(self, worker_id: int, fault: str, step: int, note: str = "") -> None:
        self.tally.note_step(step)
        # Committed, though its report may never come.
        self.inbox.put_nowait(signals.StepCommitted(self.tally.latest_step))
        self.journal.emit("fault_injected", worker_id=worker_id, fault=fault, step=step, attempt=self.spec.attempt,
                          **({"note": note} if note else {}))
        if not fault.startswith("controller-kill:"):
            self.journal.flush_soon()
            return
        # The restarted controller reads from the journal which faults fired: it must hold them.
        await asyncio.to_thread(self.journal.flush)
        # Die after this call has answered, like a crash: no cleanup. Ray restarts the actor.
        asyncio.get_running_loop().call_later(0.05, die)

    async def shard_written(self, worker_id: int, report: dict[str, Any]) -> None:
        """A rank finished (or failed) writing its shard; the last one completes the checkpoint."""
        if self._fenced(worker_id, "checkpoint_shard", step=report["step"], generation=report["generation"]):
            return
        self.inbox.put_nowait(signals.ShardWritten(report["rank"], report["step"]))
        if "error" in report or "skipped" in report:
            why = report.get("skipped") or f"could not write: {report['error']}"
            self._skipped(report["step"], f"rank {report['rank']}: {why}")
            return
        loop = asyncio.get_running_loop()
        try:
            saved = await loop.run_in_executor(self.manifests, self.shards.add, report)
        except Exception as exc:  # the store failed the manifest's write: the checkpoint never completes
            self._skipped(report["step"], f"its manifest could not be written: {type(exc).__name__}: {exc}")
            return
        if saved is not None:
            self.latest_checkpoint, event = saved
            self.metrics.checkpoint_saved(event["stall_s"])
            self.journal.emit("checkpoint_saved", **event)
            # Only now that a restart offered from here on takes the new checkpoint do older ones
            # go; the one a restart in flight restores stays until that generation formed.
            restoring = self.restoring if self.restoring and self.protocol.running < self.restoring[0] else None
            await loop.run_in_executor(self.manifests, self.shards.retain, self.latest_checkpoint.step,
                                       [restoring[1]] if restoring else [])

    def _skipped(self, step: int, reason: str) -> None:
        self.unsaved[step] = reason
        self.journal.emit("checkpoint_skipped", step=step, reason=reason)

    def _warn_of_unsaved_checkpoints(self) -> None:
        """A run that finished with a checkpoint past its latest never completed (a shard or the
        manifest failed to write, a member died uploading) says so: `Result.checkpoint` is older
        than the training it returns, and a resume trains again from there."""
        latest = self.latest_checkpoint.step if self.latest_checkpoint is not None else None
        unsaved = {step: why for step, why in {**self.shards.incomplete(), **self.unsaved}.items()
                   if latest is None or step > latest}
        if unsaved:
            step = max(unsaved)
            self.journal.emit("warning", worker_id=None, kind="checkpoint_unsaved", message=(
                f"the run finished at step {self.tally.step}, but its checkpoint of step {step} was not saved "
                f"({unsaved[step]}); its latest checkpoint is "
                f"{'none' if latest is None else f'step {latest}'}, where a resume of this run starts. Check that "
                f"every worker can write to {self.storage.uri} (checkpoint_skipped in the journal has each reason)"))

    def _fenced(self, worker_id: int, refused: str, **fields: Any) -> bool:
        """Refuse what a worker the controller gave up on sends (`Protocol.fenced`): cut off by
        the network, it may run on for minutes in a generation that has moved on. Journaled
        once per worker and kind of report."""
        given_up_for = self.protocol.fenced(worker_id)
        if not given_up_for:
            return False
        if (worker_id, refused) not in self.refused:
            self.refused.add((worker_id, refused))
            self.journal.emit("fenced", worker_id=worker_id, refused=refused, **fields,
                              reason=f"the controller gave up on worker {worker_id} "
                              f"({given_up_for}): nothing it sends counts")
        return True

    # --- carrying out the protocol's actions -----------------------------------------------
    async def _execute(self, actions: list[signals.Action]) -> None:
        # Workers are started last, and off this loop (`_start_workers`): a heal's offer, in the
        # same batch, must not wait for that (a call to the GCS and one actor creation per worker).
        ordered = sorted(actions, key=lambda action: isinstance(action, signals.StartWorkers))
        for action in ordered:
            if isinstance(action, signals.Emit):
                self.journal.emit(action.type, **action.fields)
                if action.type == "recovery":
                    self.metrics.recovered()
            elif isinstance(action, signals.StartWorkers):
                starting = asyncio.ensure_future(self._start_workers(action.worker_ids))
                self.starting.add(starting)
                starting.add_done_callback(self.starting.discard)
            elif isinstance(action, signals.Prepare):
                for worker_id in action.members:
                    asyncio.ensure_future(self._prepare(worker_id, action.generation))
            elif isinstance(action, signals.Offer):
                self._offer(action)
                await self._fire_formation_faults()
            elif isinstance(action, signals.Abort):
                abort_generation(self.store, action.generation)
                for worker_id in action.workers:
                    self.handles[worker_id].abort.remote(action.generation)
            elif isinstance(action, signals.Forget):
                self.forgetting.submit(self._forget, action.generations)
            elif isinstance(action, signals.Kill):
                if action.worker_id in self.handles:
                    ray.kill(self.handles[action.worker_id])
                else:
                    self.kill_when_created.add(action.worker_id)  # a replica's mate still being created
            elif isinstance(action, signals.ReadProbes):
                asyncio.ensure_future(self._poll(action.members))
        if self.journal.due:
            self.journal.flush_soon()
        if self.placement_groups:
            self._free_lost_replicas()

    def _forget(self, generations: tuple[tuple[int, int], ...]) -> None:
        for generation, world_size in generations:
            forget_generation(self.forget_store, generation, world_size, self.spec.scaling.backend)

    async def _prepare(self, worker_id: int, generation: int) -> None:
        try:
            step = await self.handles[worker_id].prepare.remote(generation)
        except RayActorError:
            return  # its death arrives through its run call
        self.inbox.put_nowait(signals.SwitchPrepared(worker_id, generation, step))

    def _offer(self, offer: signals.Offer) -> None:
        formation, restart = offer.formation, offer.restart
        if restart and self.latest_checkpoint is not None:
            self.restoring = (formation.generation, self.latest_checkpoint.step)
        members = formation.members
        nodes = {w: self.protocol.node_of(w) for w in members}
        node_order = list(dict.fromkeys(nodes.values()))
        placement = tuple(node_order.index(nodes[w]) for w in members)  # each rank's node_rank
        for rank, worker_id in enumerate(members):
            same_node = [w for w in members if nodes[w] == nodes[worker_id]]
            self.handles[worker_id].offer.remote(GenerationSpec(
                generation=formation.generation, rank=rank, world_size=len(members),
                local_rank=same_node.index(worker_id), local_world_size=len(same_node),
                node_rank=placement[rank], nodes=placement, store_host=self.store_host, store_port=self.store.port,
                backend=self.spec.scaling.backend, reason=formation.reason.value,
                collective_timeout_s=self.spec.run.failure_config.collective_timeout_s,
                connect_timeout_s=offer.connect_timeout_s, switch_step=formation.switch_step, restart=restart,
                resume_from=self.latest_checkpoint if restart else None, newcomers=offer.newcomers,
            ))

    async def _fire_formation_faults(self) -> None:
        """An injected controller death right after an offer: the formation is under way."""
        for fault in self.spec.faults:
            if fault.kind == "controller-kill" and fault.where == "formation" \
                    and self.protocol.committed_step >= fault.step and self.store.add(f"fault/{fault.spec()}", 1) == 1:
                await self.fault_fired(-1, fault.spec(), self.protocol.committed_step)

    async def _poll(self, members: tuple[int, ...]) -> None:
        """Ping `members`; one whose call failed is left out: its process died, and its outstanding
        `run` call reports the death (a death is not an unreachable member)."""
        async def one(worker_id: int) -> signals.ProbeReading | None | object:
            answer = await _answer_within(self.handles[worker_id].read_probe.remote(),
                                          self.spec.run.failure_config.ping_timeout_s)
            return signals.ProbeReading(**answer) if isinstance(answer, dict) else answer

        answers = await asyncio.gather(*(one(w) for w in members))
        # Kept by type, not by `_DIED`'s identity: a CI run once handed the protocol a bare object here.
        self.inbox.put_nowait(signals.ProbesRead({w: a for w, a in zip(members, answers)
                                                  if a is None or isinstance(a, signals.ProbeReading)}))

    async def _start_workers(self, worker_ids: tuple[int, ...]) -> None:
        """Place the workers here, create their actors on a thread, then watch them here. Ray's
        actor creation is far slower where the driver has imported ray.data, and on this loop a
        heal's reports waited behind it, about 0.2 s each heal."""
        try:
            created = await asyncio.to_thread(self._create_workers, self._place_workers(worker_ids))
        except BaseException as exc:
            self.start_error = exc  # raised by `run` at its next observation (a tick at the latest)
            return
        for worker_id, handle in created.items():
            self.handles[worker_id] = handle
            if worker_id in self.kill_when_created:
                ray.kill(handle)
            asyncio.ensure_future(self._watch(worker_id, handle))

    def _place_workers(self, worker_ids: tuple[int, ...]) -> dict[int, Any]:
        """Each worker's scheduling strategy: off the nodes to avoid, or in its replica's placement group."""
        config = self.spec.run.failure_config
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        avoid = policies.nodes_to_avoid(self.protocol.node_failures, time.time(), config.node_failure_limit,
                                        config.node_cooldown_s, alive)
        size = self.spec.scaling.replica_size
        # A replica's placement group takes its bundles where Ray finds room, avoided nodes included.
        avoiding = "new workers avoid it until then" if size == 1 else "new replicas do not avoid it (not built)"
        for node in sorted(avoid - self.avoided):
            self.journal.emit("decision", action="AVOID_NODE", node=node, failures=self.protocol.failures,
                              reason=f"{config.node_failure_limit} worker failures on node {node} within FailureConfig("
                              f"node_cooldown_s={config.node_cooldown_s}); {avoiding}")
        self.avoided = avoid
        placement = NodeLabelSchedulingStrategy(hard={NODE_ID_LABEL: NotIn(*sorted(avoid))}) if avoid else None
        return {w: self._replica_placement(w, size) if size > 1 else placement for w in worker_ids}

    def _create_workers(self, placements: dict[int, Any]) -> dict[int, Any]:
        """The workers' actors, by worker id, each scheduled by its placement."""
        resources = dict(self.spec.scaling.worker_resources())
        num_cpus, num_gpus = resources.pop("CPU", 0), resources.pop("GPU", 0)
        me = ray.get_runtime_context().current_actor
        size = self.spec.scaling.replica_size
        straggler_check = self.spec.run.failure_config.straggler_factor is not None
        created = {}
        for worker_id, placement in placements.items():
            created[worker_id] = Worker.options(
                num_cpus=num_cpus, num_gpus=num_gpus, resources=resources, max_restarts=0, scheduling_strategy=placement,
            ).remote(
                worker_id, me, self.spec.data, self.spec.run.checkpoint_config, self.storage, self.spec.faults,
                self.spec.scaling.use_gpu, num_cpus, self.spec.strategy, ReplicaShape.of(self.spec.scaling),
                worker_id % size, self.spec.scaling.max_workers, self.spec.attempt, straggler_check=straggler_check,
            )
        return created

    def _replica_placement(self, worker_id: int, size: int) -> PlacementGroupSchedulingStrategy:
        """A replica's workers share one placement group, packed on as few nodes as fit them, so a
        node's loss takes out the replicas on it and no others. Bundle i holds the replica's worker i."""
        replica = worker_id // size
        if replica not in self.placement_groups:
            bundle = {k: v for k, v in self.spec.scaling.worker_resources().items() if v}
            name = f"elastic-{self.spec.run.name}-{self.spec.attempt[:8]}-replica-{replica}"
            self.placement_groups[replica] = placement_group([bundle] * size, strategy="PACK", name=name)
        return PlacementGroupSchedulingStrategy(self.placement_groups[replica],
                                                placement_group_bundle_index=worker_id % size)

    def _free_lost_replicas(self) -> None:
        """Give back the placement group of each replica whose workers are all gone."""
        for replica in list(self.placement_groups):
            size = self.spec.scaling.replica_size
            workers = range(replica * size, (replica + 1) * size)
            if all(self.protocol.gone(w) for w in workers):
                remove_placement_group(self.placement_groups.pop(replica))

    async def _watch(self, worker_id: int, handle: Any) -> None:
        """The outstanding `run` call: its end is the worker's exit, its failure the process's death."""
        try:
            outcome = await handle.run.remote(self.loop_ref, self.spec.train_loop_config)
        except RayActorError as exc:
            self.inbox.put_nowait(signals.WorkerExited(worker_id, signals.Exit.DIED,
                                                       f"{type(exc).__name__}: worker process died"))
            return
        except Exception as exc:  # `run` itself failed past the train loop (its last flush): the run must hear of it
            self.inbox.put_nowait(signals.WorkerExited(worker_id, signals.Exit.APP_ERROR, f"{type(exc).__name__}: {exc}",
                                                       traceback=traceback.format_exc()))
            return
        self.inbox.put_nowait(signals.WorkerExited(
            worker_id, signals.Exit(outcome["outcome"]), outcome.get("error", outcome.get("reason", "")),
            outcome.get("step", 0), outcome.get("traceback", ""), outcome.get("value"), outcome.get("model")))

    async def _tick(self) -> None:
        config = self.spec.run.failure_config
        stragglers = (None if config.straggler_factor is None
                      else StragglerCheck(config.straggler_factor, config.straggler_steps))
        while True:
            await asyncio.sleep(TICK_S)
            if stragglers is not None:
                members = self.protocol.members
                straggling = stragglers.read({w: self.tally.compute.get(w, {}) for w in members},
                                             self.tally.link_rates(members, config.straggler_steps))
                if straggling is not None:
                    self.tally.forget_stragglers()  # the next generation is judged on its own steps
                    self.inbox.put_nowait(straggling)
            deadline = policies.hang_deadline(self.tally.step_times, config.hang_factor, config.hang_floor_s,
                                              config.hang_ceiling_s)
            reach = policies.reach_deadline(self.tally.step_times, config.reach_floor_s, config.reach_ceiling_s)
            self.inbox.put_nowait(signals.Tick(self.tally.last_step_time, deadline, reach))
            self.metrics.update(self.tally.step_times, len(self.protocol.members), self.tally.samples_per_s(),
                                self.tally.step, self._goodput())
            sample = self.tally.sample()
            if sample:
                self.journal.emit("metrics", world_size=len(self.protocol.members), **sample)
            self.journal.flush_soon()

    async def _stop_all(self) -> None:
        if self.protocol.finished:
            self._warn_of_unsaved_checkpoints()
            self.journal.emit("run_finished", step=self.tally.step, goodput=self._goodput(),
                              wall_s=time.time() - self.started)
        else:
            self.journal.emit("run_failed", error=getattr(self.protocol.state, "error", "the controller stopped"))
        if self.starting:
            await asyncio.wait(self.starting)  # each worker created is killed below
        for handle in self.handles.values():
            ray.kill(handle)
        for group in self.placement_groups.values():
            remove_placement_group(group)
        try:
            await asyncio.to_thread(self.journal.flush)
        except Exception as exc:  # the store is away: the driver gets the events from memory and a warning
            self.journal.flush_error = f"{type(exc).__name__}: {exc}"

    def _goodput(self) -> float:
        wall = time.time() - self.started
        return self.tally.productive_s / wall if wall > 0 else 0.0

    def _result(self) -> dict[str, Any]:
        state = self.protocol.state
        outcome = self.protocol.rank0_outcome()
        failure = None if self.protocol.finished else {
            "error": state.error, "rank": state.rank, "traceback": state.traceback, "kind": state.kind}
        return {
            "finished": self.protocol.finished,
            "failure": failure,
            "metrics": self.tally.last_metrics,
            "step": self.tally.step,
            "goodput": self._goodput(),
            "value": outcome.value if outcome else None,
            "model": outcome.model if outcome else None,
            "events_uri": self.storage.uri + "/" + EventJournal.FILE,
            "checkpoint": self.latest_checkpoint,
            "events": self.journal.events_since_start(self.spec.attempt),
            "journal_error": self.journal.flush_error and
            f"{self.journal.unwritten} events of the run could not be written to {self.storage.uri}: "
            f"{self.journal.flush_error}",
        }


_DIED = object()  # what `_answer_within` gives for a call that failed


async def _answer_within(ref: Any, timeout_s: float) -> Any:
    """The call's result, _DIED if it failed (a dead actor's call fails), or None if it took
    longer than `timeout_s`.

    Not asyncio.wait_for: on timeout it waits for the cancelled call to wind down, and an
    ObjectRef of a call to a stuck actor may never do so, which froze the whole controller.
    """
    async def answer() -> Any:
        try:
            return await ref
        except Exception:
            return _DIED

    task = asyncio.ensure_future(answer())
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    return task.result() if done else None
