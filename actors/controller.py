"""The controller actor: one per run. It hosts the rendezvous, watches workers and acts.

Everything the controller learns arrives as an observation on one asyncio queue: a worker is
ready, a worker's `run` call ended (finished, raised, or the process died), a worker's group
broke, a generation formed. After each observation it asks the pure policies in
`elastic.policies` what to do, logs the decision as an event, and acts: start workers, offer a
new generation, or end the run. `elastic.states` lists the states it moves through.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
import torch.distributed as dist
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeLabelSchedulingStrategy, NotIn

from actors.metrics import RunMetrics
from actors.worker import Worker
from elastic import policies, states
from elastic.config import DataConfig, RunConfig, ScalingConfig
from elastic.checkpoint import (
    MANIFEST,
    Checkpoint,
    checkpoint_steps,
    checkpoint_storage,
    latest_complete,
    step_dir,
    steps_to_delete,
    write_manifest,
)
from elastic.events import EventJournal, read_events
from elastic.faults import Fault
from elastic.group import FORMATION_TIMEOUT_S, GenerationSpec
from elastic.progress import ProgressTracker
from elastic.storage import RunStorage

READY_POLL_S = 3600.0
# Longer than a worker's own formation timeout, so its failure report arrives first.
FORM_TIMEOUT_S = 2 * FORMATION_TIMEOUT_S
MAX_FAILED_FORMATIONS = 5
STUCK_GRACE_S = 2.0
NODE_ID_LABEL = "ray.io/node-id"  # a label Ray gives every node
PING_TIMEOUT_S = 2.0
TICK_S = 0.5
FINISH_GRACE_S = 5.0
START_GRACE_S = 2.0


# Compared by value, not identity: Ray may ship the controller's functions with copies of it.
STUCK = {"ok": False, "error": "did not report", "stuck": True}


async def _outcomes_until_first_failure(waits: list[Any], grace_s: float) -> list[Any]:
    """Each member's formation outcome. Once one member reports a failure, the others get
    `grace_s` more; those still silent then are marked STUCK instead of waited for."""
    tasks = [asyncio.ensure_future(_settled(w)) for w in waits]
    pending = set(tasks)
    timeout = None
    while pending:
        done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
        if any(not (isinstance(t.result(), dict) and t.result().get("ok")) for t in done):
            timeout = grace_s
    for task in pending:
        task.cancel()
    return [t.result() if t.done() and not t.cancelled() else STUCK for t in tasks]


async def _answer_within(ref: Any, timeout_s: float) -> Any:
    """The call's result, or None if it failed or took longer than `timeout_s`.

    Not asyncio.wait_for: on timeout it waits for the cancelled call to wind down, and an
    ObjectRef of a call to a stuck actor may never do so, which froze the whole controller.
    """
    async def answer() -> Any:
        try:
            return await ref
        except Exception:  # a dead actor's call fails: no answer
            return None

    task = asyncio.ensure_future(answer())
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    return task.result() if done else None


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


async def _settled(ref: Any) -> Any:
    try:
        return await ref
    except Exception as exc:  # a dead member's call fails; that is an outcome too
        return {"ok": False, "error": f"{type(exc).__name__}"}


@dataclass
class WorkerRecord:
    worker_id: int
    handle: Any
    status: str = "pending"  # pending -> ready -> member -> gone
    was_member: bool = False
    evicted_for: str = ""  # set when the controller kills it (hang, straggler): its death is expected
    node_id: str = ""
    pid: int = 0


@dataclass
class RunSpec:
    """What the driver hands to the controller."""

    train_loop: Callable
    train_loop_config: dict[str, Any]
    scaling: ScalingConfig
    run: RunConfig
    data: DataConfig
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
        # Ray re-runs __init__ when it restarts a dead controller; the journal tells it apart
        # from a new fit() of the same run, which starts its own attempt.
        self.restarted = any(e["type"] == "run_started" and e.get("attempt") == spec.attempt for e in self.journal.events)
        for event in self.journal.events:
            if event["type"] == "fault_injected" and event.get("attempt") == spec.attempt:
                self.store.add(f"fault/{event['fault']}", 1)  # a fault fires once per attempt, across restarts
        self.store_host = ray.util.get_node_ip_address()
        self.state: states.ControllerState = states.Starting()
        self.workers: dict[int, WorkerRecord] = {}
        self.members: list[int] = []
        self.generation = -1
        self.world_size = 0
        self.generation_broken = False
        self.failures = 0
        self.failed_formations = 0
        self.formed_at = time.time()
        self.node_failures: dict[str, list[float]] = {}
        self.metrics = RunMetrics(spec.run.name)
        self.latest_checkpoint: Checkpoint | None = None
        self.shards: dict[tuple[int, int], list[dict[str, Any]]] = {}
        self.failure_time: float | None = None
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.progress = ProgressTracker(spec.data.global_batch_size, spec.data.max_steps)
        self.outcomes: dict[int, dict[str, Any]] = {}
        self.loop_ref = None
        self.failure: dict[str, Any] | None = None
        self.first_ready_at: float | None = None
        self.started = time.time()

    # --- called by the driver ----------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        if self.restarted:
            self.journal.emit("controller_restarted", reason="the controller actor died and Ray restarted it")
        self.journal.emit("run_started", name=self.spec.run.name, attempt=self.spec.attempt,
                          scaling=self.spec.scaling.model_dump(),
                          data=self.spec.data.model_dump(), faults=[f.spec() for f in self.spec.faults])
        self.latest_checkpoint = self.spec.resume_from or await asyncio.to_thread(
            latest_complete, self.storage,
            lambda step, reason: self.journal.emit("checkpoint_skipped", step=step, reason=reason),
        )
        if self.latest_checkpoint is not None:
            self.journal.emit("run_resumed", step=self.latest_checkpoint.step, checkpoint=self.latest_checkpoint.path)
        self.loop_ref = ray.put(self.spec.train_loop)
        self._start_workers()
        self._enter(states.Waiting(time.time(), time.time() + self.spec.run.failure_config.capacity_timeout_s),
                    "waiting for min_workers to be ready")
        ticker = asyncio.ensure_future(self._tick())
        try:
            while not isinstance(self.state, (states.Finished, states.Failed)):
                kind, *payload = await self.inbox.get()
                await getattr(self, f"_on_{kind}")(*payload)
        finally:
            ticker.cancel()
            await self._stop_all()
            self.journal.flush()
        return self._result()

    async def status(self) -> dict[str, Any]:
        events = self.journal.events
        return {
            "state": self.state.name,
            **self.progress.snapshot(),
            "world_size": len(self.members),
            "generation": self.generation,
            "last_event": events[-1]["type"] if events else "",
        }

    # --- called by workers ---------------------------------------------------------------
    async def ingest(self, worker_id: int, items: list[dict[str, Any]]) -> None:
        self.progress.ingest(worker_id, items)

    async def group_broken(self, worker_id: int, generation: int) -> None:
        self.inbox.put_nowait(("broken", worker_id, generation, time.time()))

    async def fault_fired(self, worker_id: int, fault: str, step: int, note: str = "") -> None:
        self.progress.note_step(step)
        self.journal.emit("fault_injected", worker_id=worker_id, fault=fault, step=step, attempt=self.spec.attempt,
                          **({"note": note} if note else {}))
        await asyncio.to_thread(self.journal.flush)
        if fault.startswith("controller-kill:"):
            # Die after this call has answered, like a crash: no cleanup. Ray restarts the actor.
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)

    async def shard_written(self, report: dict[str, Any]) -> None:
        """A rank finished (or failed) writing its shard; the last one completes the checkpoint."""
        step, world_size = report["step"], report["world_size"]
        if "error" in report:
            self.journal.emit("checkpoint_skipped", step=step, reason=f"rank {report['rank']} could not write: {report['error']}")
            return
        shards = self.shards.setdefault((step, world_size), [])
        shards.append(report)
        if len(shards) < world_size:
            return
        del self.shards[(step, world_size)]
        files = [f for r in shards for f in r["files"]]
        metadata = next(r["metadata"] for r in shards if r["rank"] == 0)
        manifest = await asyncio.to_thread(write_manifest, self.storage, shards[0]["progress"], world_size, files, metadata)
        self.latest_checkpoint = Checkpoint(checkpoint_storage(self.storage, step), manifest)
        self.metrics.checkpoint_saved(max(r["stall_s"] for r in shards))
        self.journal.emit("checkpoint_saved", step=step, bytes=sum(f["size"] for f in files),
                          stall_s=max(r["stall_s"] for r in shards), upload_s=max(r["upload_s"] for r in shards),
                          path=self.latest_checkpoint.path)
        await asyncio.to_thread(self._retain)

    def _retain(self) -> None:
        steps = checkpoint_steps(self.storage)
        complete = [s for s in steps if self.storage.size(f"{step_dir(s)}/{MANIFEST}") is not None]
        for step in steps_to_delete(steps, complete, self.spec.run.checkpoint_config.keep_last):
            self.storage.delete_dir(step_dir(step))

    # --- observations --------------------------------------------------------------------
    async def _on_ready(self, worker_id: int, ready: bool) -> None:
        record = self.workers[worker_id]
        if not ready or record.status != "pending":
            return
        info = await record.handle.info.remote()
        record.status, record.node_id, record.pid = "ready", info["node_id"], info["pid"]
        self.journal.emit("worker_started", worker_id=worker_id, node=info["node_id"], pid=info["pid"], host=info["host"])
        if self.generation < 0:
            # The first generation waits briefly for workers starting alongside, instead of growing at once.
            self.first_ready_at = self.first_ready_at or time.time()
            if self._with_status("pending"):
                return
        await self._reconcile()

    async def _on_exited(self, worker_id: int, outcome: dict[str, Any] | None, error: str | None) -> None:
        record = self.workers[worker_id]
        was_member = worker_id in self.members
        rank = self.members.index(worker_id) if was_member else None
        if record.status == "gone":
            return
        record.status = "gone"
        if outcome and outcome["outcome"] == "finished":
            # The train loop returned: at max_steps, or because the user ended it early.
            self.outcomes[worker_id] = outcome
            self._enter(states.Finished(), f"rank {rank} finished its train loop at step {outcome['step']}")
            return
        if outcome and outcome["outcome"] == "evicted":
            return
        kind = "app_error" if outcome else "death"
        cause = outcome["error"] if outcome else error
        if not record.evicted_for:  # an eviction already logged its own worker_failed (and node failure)
            self.journal.emit("worker_failed", worker_id=worker_id, rank=rank, node=record.node_id, pid=record.pid,
                              kind=kind, cause=cause, generation=self.generation)
            self._note_node_failure(record.node_id)
        if kind == "death" and was_member and len(self.members) == 1:
            kind = "all_lost"
        if kind != "death":
            self.failures += 1
        decision = policies.decide_failure(kind, self.failures, self.spec.run.failure_config.max_failures)
        self.journal.emit("decision", action=decision.action, reason=decision.reason)
        if decision.action == "RAISE":
            if kind == "all_lost":
                cause = f"every worker was lost (the last one: {cause}); {decision.reason}"
            self._enter(states.Failed(cause), decision.reason)
            self.failure = {"error": cause, "rank": (outcome or {}).get("rank"),
                            "traceback": (outcome or {}).get("traceback", ""), "kind": kind}
            return
        if kind == "app_error":
            ray.kill(record.handle)
        self.failure_time = self.failure_time or time.time()
        if was_member:
            self.members.remove(worker_id)
            self.generation_broken = True
        self._start_workers()
        await self._reconcile()

    async def _on_broken(self, worker_id: int, generation: int, at: float) -> None:
        if generation != self.generation or self.generation_broken:
            return
        self.failure_time = self.failure_time or at
        self.generation_broken = True
        alive = await self._ping(self.members)
        for worker_id in [w for w in self.members if w not in alive]:
            self.journal.emit("worker_failed", worker_id=worker_id, rank=self.members.index(worker_id),
                              node=self.workers[worker_id].node_id, kind="unresponsive",
                              cause=f"no answer within {PING_TIMEOUT_S} s after its group broke",
                              generation=self.generation)
            self.workers[worker_id].status = "gone"
            ray.kill(self.workers[worker_id].handle)
        self.members = [w for w in self.members if w in alive]
        self._start_workers()
        await self._reconcile()

    async def _on_formed(self, generation: int, members: list[int], outcomes: list[Any]) -> None:
        if not isinstance(self.state, states.Reconfiguring) or self.state.generation != generation:
            return
        failed = [o for o in outcomes if not (isinstance(o, dict) and o.get("ok"))]
        # A member that never reported is stuck (e.g. in a collective of the old generation, on a
        # peer that left): it would hold every later formation too, so it goes.
        for worker_id, outcome in zip(members, outcomes):
            if outcome == STUCK and self.workers[worker_id].status != "gone":
                self._evict(worker_id, "stuck", f"did not report on forming generation {generation} while "
                            "its peers had given up on it")
                self.members.remove(worker_id)
        if failed:
            self.failed_formations += 1
            if self.failed_formations > MAX_FAILED_FORMATIONS:
                message = (f"{self.failed_formations} generations in a row failed to form; the last: {failed[0]}. "
                           "Check that workers can reach each other and the controller's TCPStore.")
                self.failure = {"error": message, "rank": None, "traceback": "", "kind": "formation"}
                self._enter(states.Failed(message), "too many failed formations")
                return
            self.journal.emit("decision", action="REFORM", reason=f"generation {generation} did not form: {failed[0]}")
            self.generation_broken = True
            await self._reconcile()
            return
        self.failed_formations = 0
        self.formed_at = time.time()
        reason, since = self.state.reason, self.state.since
        now = time.time()
        members = [{"worker_id": w, "pid": self.workers[w].pid, "node": self.workers[w].node_id} for w in self.members]
        self.journal.emit("generation_formed", generation=generation, world_size=len(self.members), reason=reason,
                          seconds=now - since, source_rank=outcomes[0]["source_rank"], step=outcomes[0]["step"],
                          members=members)
        if self.failure_time is not None:
            # Partial steps the survivors dropped, or committed steps rolled back to a checkpoint.
            rolled_back = self.progress.latest_step - outcomes[0]["step"]
            self.journal.emit("recovery", generation=generation, seconds=now - self.failure_time,
                              steps_lost=max(rolled_back, *(o["steps_lost"] for o in outcomes)),
                              world_size=len(self.members), from_checkpoint=not reason.startswith("heal"))
            self.metrics.recovered()
            self.failure_time = None
        self._enter(states.Running(generation), reason)
        self.formed_at = time.time()
        await asyncio.to_thread(self.journal.flush)
        await self._reconcile()

    async def _on_tick(self) -> None:
        if isinstance(self.state, states.Waiting) and time.time() > self.state.deadline:
            live = len(self.members) + len(self._with_status("ready"))
            message = (
                f"only {live} of min_workers({self.spec.scaling.min_workers}) workers could run for "
                f"FailureConfig(capacity_timeout_s={self.spec.run.failure_config.capacity_timeout_s}); "
                f"each worker needs {self.spec.scaling.worker_resources()}. Add capacity or lower min_workers."
            )
            self.failure = {"error": message, "rank": None, "traceback": "", "kind": "capacity"}
            self._enter(states.Failed(message), "capacity timeout")
        if self.generation < 0 and self.first_ready_at and time.time() - self.first_ready_at > START_GRACE_S:
            await self._reconcile()
        if isinstance(self.state, states.Running):
            await self._check_hang()
            self._check_stragglers()
        self.metrics.update(self.progress.step_times, len(self.members), self.progress.samples_per_s(),
                            self.progress.step, self._goodput())
        sample = self.progress.sample()
        if sample:
            self.journal.emit("metrics", world_size=len(self.members), **sample)
        await asyncio.to_thread(self.journal.flush)

    async def _check_hang(self) -> None:
        """Kill the members that stopped the run, once no step committed within the deadline."""
        config = self.spec.run.failure_config
        last = max(self.progress.last_step_time, self.formed_at)
        deadline = policies.hang_deadline(self.progress.step_times, config.hang_factor, config.hang_floor_s,
                                          config.hang_ceiling_s)
        stalled = time.time() - last
        if stalled <= deadline:
            return
        members = list(self.members)
        answers = await asyncio.gather(*(self._progress_of(w) for w in members))
        if not isinstance(self.state, states.Running) or members != self.members:
            return  # the run moved on while we asked
        for worker_id in policies.find_hung(dict(zip(members, answers))):
            self._evict(worker_id, "hang", f"no step committed for {stalled:.1f} s, past the deadline of "
                        f"{deadline:.1f} s; it was behind its peers at {answers[members.index(worker_id)]} "
                        "(step, syncs entered, all-reduces launched)", detect_s=stalled, deadline_s=deadline)

    def _check_stragglers(self) -> None:
        config = self.spec.run.failure_config
        if config.straggler_factor is None:
            return
        compute = {w: self.progress.compute.get(w, {}) for w in self.members}
        found = policies.find_straggler(compute, config.straggler_factor, config.straggler_steps)
        if found:
            worker_id, reason = found
            self.journal.emit("decision", action="EVICT", reason=f"worker {worker_id} is a straggler: {reason}")
            self._evict(worker_id, "straggler", reason)
            for times in self.progress.compute.values():
                times.clear()  # judge the next generation on its own steps

    def _note_node_failure(self, node_id: str) -> None:
        if not node_id:
            return
        now = time.time()
        config = self.spec.run.failure_config
        alive = _alive_nodes()
        before = policies.nodes_to_avoid(self.node_failures, now, config.node_failure_limit, config.node_cooldown_s,
                                         alive)
        self.node_failures.setdefault(node_id, []).append(now)
        after = policies.nodes_to_avoid(self.node_failures, now, config.node_failure_limit, config.node_cooldown_s,
                                        alive)
        for node in after - before:
            self.journal.emit("decision", action="AVOID_NODE", node=node, reason=(
                f"{config.node_failure_limit} worker failures on node {node} within "
                f"FailureConfig(node_cooldown_s={config.node_cooldown_s}); new workers avoid it until then"))

    async def _progress_of(self, worker_id: int) -> tuple[int, int, int] | None:
        answer = await _answer_within(self.workers[worker_id].handle.progress.remote(), PING_TIMEOUT_S)
        return (answer["step"], answer["entered_sync"], answer["launched"]) if answer else None

    def _evict(self, worker_id: int, kind: str, cause: str, **fields: Any) -> None:
        """Kill a live member; its death then heals like any other."""
        record = self.workers[worker_id]
        record.evicted_for = kind
        self._note_node_failure(record.node_id)
        self.journal.emit("worker_failed", worker_id=worker_id, rank=self.members.index(worker_id),
                          node=record.node_id, pid=record.pid, kind=kind, cause=cause, generation=self.generation,
                          **fields)
        ray.kill(record.handle)

    # --- decisions and actions -----------------------------------------------------------
    async def _reconcile(self) -> None:
        if isinstance(self.state, (states.Finished, states.Failed)):
            return
        if isinstance(self.state, states.Reconfiguring) and not self.generation_broken:
            return  # a formation is under way; its outcome comes back as an observation
        decision = policies.decide_membership(
            self.members, self._with_status("ready"), self.generation_broken or self.generation < 0,
            self.spec.scaling.min_workers, self.spec.scaling.max_workers,
        )
        if isinstance(decision, policies.WaitDecision):
            if not isinstance(self.state, states.Waiting):
                timeout = self.spec.run.failure_config.capacity_timeout_s
                self._enter(states.Waiting(time.time(), time.time() + timeout), decision.reason)
            return
        if isinstance(decision, policies.ResizeDecision):
            self._form(list(decision.members), decision.reason)

    def _form(self, members: list[int], reason: str) -> None:
        old_size = self.world_size
        # Only when no member has live state (a start, or every worker was lost) is storage read.
        fresh = not any(self.workers[w].was_member for w in members)
        resume_from = self.latest_checkpoint if fresh else None
        since = self.failure_time if reason.startswith("heal") and self.failure_time else time.time()
        self.generation += 1
        self.generation_broken = False
        self.members = members
        self.world_size = len(members)
        for worker_id in members:
            self.workers[worker_id].status = "member"
            self.workers[worker_id].was_member = True
        if old_size and old_size != len(members):
            self.journal.emit("rescale", generation=self.generation, from_size=old_size, to_size=len(members), reason=reason)
        self._enter(states.Reconfiguring(self.generation, reason, since), reason)
        specs = self._specs(members, resume_from)
        for worker_id, spec in zip(members, specs):
            self.workers[worker_id].handle.join.remote(spec)
        generation = self.generation
        waits = [self.workers[w].handle.wait_formed.remote(generation, FORM_TIMEOUT_S) for w in members]

        async def collect() -> None:
            outcomes = await _outcomes_until_first_failure(waits, STUCK_GRACE_S)
            self.inbox.put_nowait(("formed", generation, list(members), outcomes))

        asyncio.ensure_future(collect())

    def _specs(self, members: list[int], resume_from: Checkpoint | None) -> list[GenerationSpec]:
        nodes = list(dict.fromkeys(self.workers[w].node_id for w in members))
        specs = []
        for rank, worker_id in enumerate(members):
            node = self.workers[worker_id].node_id
            same_node = [w for w in members if self.workers[w].node_id == node]
            specs.append(GenerationSpec(
                generation=self.generation, rank=rank, world_size=len(members),
                local_rank=same_node.index(worker_id), local_world_size=len(same_node), node_rank=nodes.index(node),
                store_host=self.store_host, store_port=self.store.port, backend=self.spec.scaling.backend,
                reason=self.state.reason if isinstance(self.state, states.Reconfiguring) else "",
                collective_timeout_s=self.spec.run.failure_config.collective_timeout_s, resume_from=resume_from,
            ))
        return specs

    def _start_workers(self) -> None:
        live = len([r for r in self.workers.values() if r.status != "gone"])
        resources = dict(self.spec.scaling.worker_resources())
        num_cpus, num_gpus = resources.pop("CPU", 0), resources.pop("GPU", 0)
        me = ray.get_runtime_context().current_actor
        config = self.spec.run.failure_config
        avoid = policies.nodes_to_avoid(self.node_failures, time.time(), config.node_failure_limit,
                                        config.node_cooldown_s, _alive_nodes())
        placement = NodeLabelSchedulingStrategy(hard={NODE_ID_LABEL: NotIn(*sorted(avoid))}) if avoid else None
        for _ in range(policies.workers_to_start(live, self.spec.scaling.max_workers)):
            worker_id = len(self.workers)
            handle = Worker.options(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources, max_restarts=0,
                                    scheduling_strategy=placement).remote(
                worker_id, me, self.spec.data, self.spec.run.checkpoint_config, self.storage, self.spec.faults,
                self.spec.scaling.use_gpu, num_cpus,
            )
            self.workers[worker_id] = WorkerRecord(worker_id, handle)
            asyncio.ensure_future(self._watch(worker_id, handle))

    async def _watch(self, worker_id: int, handle: Any) -> None:
        run_ref = handle.run.remote(self.loop_ref, self.spec.train_loop_config)

        async def ready() -> None:
            try:
                self.inbox.put_nowait(("ready", worker_id, await handle.wait_ready.remote(READY_POLL_S)))
            except RayActorError:
                pass

        asyncio.ensure_future(ready())
        try:
            outcome = await run_ref
            self.inbox.put_nowait(("exited", worker_id, outcome, None))
        except RayActorError as exc:
            self.inbox.put_nowait(("exited", worker_id, None, f"{type(exc).__name__}: worker process died"))

    async def _ping(self, worker_ids: list[int]) -> set[int]:
        async def one(worker_id: int) -> int | None:
            answer = await _answer_within(self.workers[worker_id].handle.info.remote(), PING_TIMEOUT_S)
            return worker_id if answer else None

        return {w for w in await asyncio.gather(*(one(w) for w in worker_ids)) if w is not None}

    def _enter(self, state: states.ControllerState, reason: str) -> None:
        self.journal.emit("state", state=state.name, reason=reason, generation=self.generation)
        self.state = state

    def _with_status(self, status: str) -> list[int]:
        return sorted(w for w, r in self.workers.items() if r.status == status)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.inbox.put_nowait(("tick",))

    async def _stop_all(self) -> None:
        finished = isinstance(self.state, states.Finished)
        if finished:
            # Let the other members return their outcome; they end the same step.
            deadline = time.time() + FINISH_GRACE_S
            while time.time() < deadline and any(self.workers[w].status != "gone" for w in self.members):
                try:
                    kind, *payload = await asyncio.wait_for(self.inbox.get(), deadline - time.time())
                except asyncio.TimeoutError:
                    break
                if kind == "exited":
                    worker_id, outcome, _ = payload
                    self.workers[worker_id].status = "gone"
                    if outcome and outcome["outcome"] == "finished":
                        self.outcomes[worker_id] = outcome
            self.journal.emit("run_finished", step=self.progress.step, goodput=self._goodput(),
                              wall_s=time.time() - self.started)
        else:
            self.journal.emit("run_failed", error=self.state.error)
        for record in self.workers.values():
            ray.kill(record.handle)

    def _goodput(self) -> float:
        wall = time.time() - self.started
        return self.progress.productive_s / wall if wall > 0 else 0.0

    def _result(self) -> dict[str, Any]:
        finished = isinstance(self.state, states.Finished)
        # The train loop's return value of the lowest rank that finished, as Ray Train returns rank 0's.
        ranked = [w for w in self.members if w in self.outcomes] or sorted(self.outcomes)
        first = ranked[0] if ranked else None
        return {
            "finished": finished,
            "failure": None if finished else (self.failure or {"error": self.state.error}),
            "metrics": self.progress.last_metrics,
            "step": self.progress.step,
            "goodput": self._goodput(),
            "value": self.outcomes[first]["value"] if first is not None else None,
            "events_uri": self.storage.uri + "/" + EventJournal.FILE,
            "checkpoint": self.latest_checkpoint,
        }
