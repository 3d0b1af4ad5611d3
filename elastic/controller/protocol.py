"""The elastic protocol: the controller's decisions as one explicit state machine, without Ray.

`Protocol.step(observation, now)` performs one transition and returns the actions the
controller actor carries out (`elastic.controller.signals`). Nothing here touches Ray, so every
transition, abort included, is tested with a fake worker group (`elastic.controller.fake_group`,
`tests/test_protocol.py`).

The protocol keeps the membership: its workers, the running generation and the state it is in
(`elastic.controller.states`). Whether the run stalled, and who is unreachable, cut off, hung or
a straggler, the detectors find (`elastic.controller.detectors`); the protocol reacts to their
findings, as to any other observation.

Invariants (docs/architecture.md explains them):
- Generation numbers only grow; a number offered once is never offered again.
- A generation commits when every one of its members reported it formed. Membership, and
  holding live state, count only from committed generations.
- A member that dies, or a group that breaks, before its generation commits aborts it at
  once: the barrier key is set to "abort" and the next generation is offered without the dead.
- Once a generation commits, every older one offered is forgotten (`Forget`): its members have
  all left it, so the store keys it left are deleted.
- A formation in which no member holds live state restores the latest checkpoint (a
  restart, logged as one); a newcomer never forms a generation alone with fresh weights.
- A grow never stops the running members before their agreed switch step; a death during it
  turns it into a heal.
- Every loop is bounded: application errors and lost runs by `max_failures`, formations that
  fail by `MAX_FAILED_FORMATIONS`, heals with no step committed in between by
  `max_heals_without_step`; a stall by the hang deadline, which follows the step time.

Cost: an observation that answers for one worker (ready, acknowledged, prepared, broken, ended)
costs O(1) amortized, whatever the world size W: workers are indexed by status and members by
rank, and answers are collected in place. A decision looks at every member once (a death's
heal, an offer, a commit, a poll): O(W). So a formation costs O(W) in all
(`tests/test_protocol_cost.py` counts it).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from dataclasses import dataclass, field

from elastic.config import FailureConfig, ScalingConfig
from elastic.controller import policies
from elastic.controller.detectors import HangCheck, PartitionCheck, ReachCheck, StallWatch
from elastic.controller.signals import (
    PREPARE_SLACK_STEPS, Abort, Action, CutOff, Deadlocked, Emit, Exit, Forget, FormedReport, GroupBroken, Hung, Kill,
    Observation, Offer, ReadProbes, Prepare, ProbesRead, ShardWritten, StartWorkers, StepCommitted, Straggling,
    SwitchPrepared, Tick, Unreachable, WorkerExited, WorkerReady,
)
from elastic.controller.states import (
    TERMINAL, ControllerState, Failed, Finished, Finishing, Formation, Forming, Preparing, Reason, Running, Waiting,
)

MAX_FAILED_FORMATIONS = 5


class Status(enum.Enum):
    STARTING = "starting"  # requested from Ray, not ready yet
    IDLE = "idle"  # ready: a newcomer or a warm spare
    MEMBER = "member"  # in the newest committed generation
    GONE = "gone"


@dataclass
class WorkerRecord:
    worker_id: int
    status: Status = Status.STARTING  # changed only through `Protocol._move`, which keeps the index by status
    node: str = ""
    pid: int = 0
    holds_state: bool = False  # was a member of a committed generation: holds live run state
    evicted_for: str = ""  # the controller gave up on it (unreachable, hang, straggler): its death is expected


@dataclass
class Protocol:
    scaling: ScalingConfig
    failure: FailureConfig
    max_steps: int | None  # None: the run ends where the train loops return
    switch_every: int = 1  # planned switches land on multiples of this step (local SGD's interval)
    generation: int = -1  # the newest generation offered (restored from the journal on a restart)
    failures: int = 0
    state: ControllerState = field(default_factory=lambda: Waiting(0.0, float("inf"), "starting"))
    workers: dict[int, WorkerRecord] = field(default_factory=dict)
    running: int = -1  # the newest committed generation
    members: tuple[int, ...] = ()  # its live members, in rank order
    running_size: int = 0  # its size when it committed
    broken: bool = False  # it lost a member and must heal
    committed_step: int = 0  # the newest committed step reported
    failure_at: float | None = None  # first sign of the failure being healed
    node_failures: dict[str, list[float]] = field(default_factory=dict)
    outcomes: dict[int, WorkerExited] = field(default_factory=dict)
    failed_formations: int = 0
    connect_s: float | None = None  # the slowest member's connect in the last generation that formed
    heals_without_step: int = 0
    # A member declined a heal with newcomers from inside a between-steps block (`FormedReport.in_block`):
    # the next generation heals with the live members alone, at any size, and grows once it formed.
    heal_without_newcomers: bool = False
    committed_at_step: int = -1
    first_ready_at: float | None = None
    detect_s: float = 0.0  # how long the failure being healed went unseen (an unreachable member's stall)
    stall: StallWatch = field(init=False, default_factory=StallWatch)  # when to poll the members
    # The ids of the workers in each status, so that nothing needs to look at every worker to
    # find the idle ones or count the live ones.
    _by_status: dict[Status, set[int]] = field(init=False, repr=False, compare=False)
    # The world size of each generation offered and not yet forgotten: the running one and any since.
    _unforgotten: dict[int, int] = field(init=False, repr=False, compare=False)
    # `members` and each one's rank, rebuilt when `members` is another tuple (`_rank`).
    _ranked: tuple[tuple[int, ...], dict[int, int]] = field(init=False, repr=False, compare=False)
    # What a poll's answers say, each check by the failure config's threshold.
    _reach: ReachCheck = field(init=False, repr=False, compare=False)
    _partition: PartitionCheck = field(init=False, repr=False, compare=False)
    _hang: HangCheck = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_status = {status: set() for status in Status}
        for worker_id, record in self.workers.items():
            self._by_status[record.status].add(worker_id)
        self._ranked = ((), {})
        self._unforgotten = {}
        self._reach = ReachCheck(self.failure.ping_timeout_s)
        self._partition = PartitionCheck(self.failure.link_silence_s)
        self._hang = HangCheck(self.failure.hang_ceiling_s)

    # --- entry points ---------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        self.stall.progressed(now)
        deadline = now + self.failure.capacity_timeout_s
        reason = "waiting for min_workers to be ready"
        return [*self._enter(Waiting(now, deadline, reason), reason), *self._top_up()]

    def step(self, observation: Observation, now: float) -> list[Action]:
        if isinstance(self.state, TERMINAL):
            return []
        return _HANDLERS[type(observation)](self, observation, now)

    @property
    def finished(self) -> bool:
        return isinstance(self.state, Finished)

    def rank0_outcome(self) -> WorkerExited | None:
        """The outcome of the lowest rank that finished, as Ray Train returns rank 0's."""
        ranked = [w for w in self.members if w in self.outcomes] or sorted(self.outcomes)
        return self.outcomes[ranked[0]] if ranked else None

    def fenced(self, worker_id: int) -> str:
        """Why what `worker_id` sends must be refused ("" while it counts): the controller gave up
        on it (unreachable, hung or evicted), so it may still run, cut off, on a generation that
        moved on."""
        record = self.workers.get(worker_id)
        return record.evicted_for if record is not None else ""

    def node_of(self, worker_id: int) -> str:
        """The node a ready worker runs on ("" before it is ready)."""
        return self.workers[worker_id].node

    def gone(self, worker_id: int) -> bool:
        """Whether the protocol lost `worker_id`: dead, finished, or given up on."""
        return self.workers[worker_id].status == Status.GONE

    # --- observations ---------------------------------------------------------------------
    def _on_ready(self, obs: WorkerReady, now: float) -> list[Action]:
        record = self.workers.get(obs.worker_id)
        if record is None or record.status != Status.STARTING:
            return []
        self._move(record, Status.IDLE)
        record.node, record.pid = obs.node, obs.pid
        self.first_ready_at = self.first_ready_at or now
        started = {"worker_id": obs.worker_id, "node": obs.node, "pid": obs.pid, "host": obs.host, "binds": obs.binds}
        if self.scaling.replica_size > 1:
            started["replica"] = obs.worker_id // self.scaling.replica_size
        actions = [Emit("worker_started", started)]
        return actions + self._reconcile(now)

    def _on_exited(self, obs: WorkerExited, now: float) -> list[Action]:
        record = self.workers[obs.worker_id]
        if record.status == Status.GONE:
            return []
        rank = self._rank(obs.worker_id)
        if obs.exit == Exit.FINISHED and self.generation < 0:
            # Nothing was ever offered: the loop trained alone, if at all. Never a success.
            self._move(record, Status.GONE)
            message = (f"worker {obs.worker_id} finished its train loop before any generation was offered: the loop "
                       "never waited in ctx.steps(dataset) for its peers, so nothing was trained together")
            return self._enter(Failed(message, "app_error"), "finished without a generation")
        if obs.exit == Exit.FINISHED:
            self._move(record, Status.GONE)
            self.outcomes[obs.worker_id] = obs
            actions = self._abort_formation(now) if isinstance(self.state, (Preparing, Forming)) else []
            if not isinstance(self.state, Finishing):
                ending = {w for w in self.members if self.workers[w].status != Status.GONE}
                reason = f"rank {rank} finished its train loop at step {obs.step}"
                actions += self._enter(Finishing(now, ending), reason)
            return actions + self._maybe_finished(obs.worker_id)
        actions: list[Action] = []
        if obs.exit == Exit.APP_ERROR:
            self.failures += 1
            actions.append(self._worker_failed(obs.worker_id, "app_error", obs.cause, traceback=obs.traceback))
            decision = policies.decide_failure("app_error", self.failures, self.failure.max_failures)
            actions.append(self._decision(decision.action, decision.reason))
            if decision.action == "RAISE" or isinstance(self.state, Finishing):
                self._move(record, Status.GONE)
                return actions + self._enter(Failed(obs.cause, "app_error", rank, obs.traceback), decision.reason)
            actions.append(Kill(obs.worker_id))
        elif not record.evicted_for and obs.exit == Exit.DIED:
            actions.append(self._worker_failed(obs.worker_id, "death", obs.cause))
        return actions + self._lose(obs.worker_id, now)

    def _on_broken(self, obs: GroupBroken, now: float) -> list[Action]:
        if obs.generation != self.running or self.broken or isinstance(self.state, Finishing):
            return []
        self.failure_at = self.failure_at or now
        if isinstance(self.state, Forming):
            # Its members join the offered generation anyway, broken or not; only a death
            # (observed on its own) aborts it.
            return []
        actions = self._break(now)
        if isinstance(self.state, Failed):
            return actions
        if isinstance(self.state, Preparing):
            actions += self._abort_formation(now)
        return actions + self._reconcile(now)

    def _on_prepared(self, obs: SwitchPrepared, now: float) -> list[Action]:
        state = self.state
        if not isinstance(state, Preparing) or state.formation.generation != obs.generation:
            return []
        if self._rank(obs.worker_id) is None:
            return []  # only the running members were asked
        answers = state.answers
        answers[obs.worker_id] = obs.step
        if len(answers) < len(self.members):
            return []
        earliest = max(answers.values()) + PREPARE_SLACK_STEPS
        switch = -(-earliest // self.switch_every) * self.switch_every
        if self.max_steps is not None and switch >= self.max_steps:
            # Too close to the end to be worth a switch; the newcomers stay idle.
            return [Abort(state.formation.generation, self.members),
                    *self._enter(Running(self.running), f"no grow: step {switch} is past max_steps")]
        formation = dataclasses.replace(state.formation, switch_step=switch, decided_at=now)
        return [self._offer(formation), *self._enter(Forming(formation), f"{formation.detail}, switching at step {switch}")]

    def _on_formed(self, obs: FormedReport, now: float) -> list[Action]:
        """A member's report of joining a generation; one that could not is journaled even when the
        generation was given up meanwhile (a death inside its connect, seen first)."""
        actions = self._formed(obs, now)
        if obs.ok:
            return actions
        failed = {"generation": obs.generation, "worker_id": obs.worker_id, "error": obs.error}
        return [Emit("formation_failed", failed), *actions]

    def _formed(self, obs: FormedReport, now: float) -> list[Action]:
        state = self.state
        if not isinstance(state, Forming) or state.formation.generation != obs.generation:
            return []
        if not obs.ok and obs.state_lost:
            # No worker's state can be used: the next formation restarts from the latest
            # checkpoint. A death is not a failure, so this is not counted as one.
            if not obs.checkpointed:
                message = (f"generation {obs.generation} lost part of the run's state ({obs.error}) and there is no "
                           "complete checkpoint to restart from; checkpoint often (CheckpointConfig(every_steps=N)), "
                           "and with ZeRO keep Strategy(zero_replicas=1)")
                return self._enter(Failed(message, "state_lost"), "state lost, no checkpoint")
            for record in self.workers.values():
                record.holds_state = False
            return self._form_again("RESTART", f"generation {obs.generation} lost part of the run's state on worker "
                                    f"{obs.worker_id} ({obs.error}); restarting from the latest complete checkpoint", now)
        if not obs.ok and obs.in_block:
            self.heal_without_newcomers = True
            return self._form_again("REFORM", f"worker {obs.worker_id} is inside a between-steps block, which it runs "
                                    "again in the healed generation and a newcomer could not: healing with the live "
                                    "members, then growing", now)
        if not obs.ok:
            self.failed_formations += 1
            reason = f"generation {obs.generation} did not form on worker {obs.worker_id}: {obs.error}"
            if self.failed_formations > MAX_FAILED_FORMATIONS:
                message = (f"{self.failed_formations} generations in a row failed to form; the last: {obs.error}. "
                           f"{self._formation_advice()}")
                return self._enter(Failed(message, "formation"), reason)
            return self._form_again("REFORM", reason, now)
        if obs.worker_id not in state.formation.ranks:
            return []  # only the members were offered it
        acked = state.acked
        acked[obs.worker_id] = obs
        if len(acked) < len(state.formation.members):
            return []
        return self._commit(state.formation, acked, now)

    def _on_step_committed(self, obs: StepCommitted, now: float) -> list[Action]:
        """Progress: a step past the last commit ends the count of heals without one (a crash loop's)."""
        if obs.step > self.committed_step:
            self.committed_step = obs.step
            self.heals_without_step = 0
        return []

    def _on_tick(self, obs: Tick, now: float) -> list[Action]:
        state = self.state
        if isinstance(state, Waiting):
            live = len(self.members) + len(self._by_status[Status.IDLE])
            # Enough ready workers only wait out the start's grace, however short the capacity timeout.
            if now > state.deadline and live < self.scaling.min_workers:
                return self._capacity_timeout(live)
            return self._reconcile(now)
        if self.stall.tick(now, obs.last_step_at, obs.deadline_s, obs.reach_deadline_s) is None:
            return []
        return [ReadProbes(tuple(w for w in self._watched() if self.workers[w].status != Status.GONE))]

    def _capacity_timeout(self, live: int) -> list[Action]:
        scaling = self.scaling
        if scaling.replica_size > 1:
            short = (f"only {live} of the {scaling.min_workers} workers that min_replicas("
                     f"{scaling.replica_range[0]}) replicas of {scaling.replica_size} need")
            knob = "min_replicas"
        else:
            short, knob = f"only {live} of min_workers({scaling.min_workers}) workers", "min_workers"
        message = (f"{short} could run for FailureConfig(capacity_timeout_s={self.failure.capacity_timeout_s}); "
                   f"each worker needs {scaling.worker_resources()}. Add capacity or lower {knob}.")
        return self._enter(Failed(message, "capacity"), "capacity timeout")

    def _watched(self) -> tuple[int, ...]:
        """The members a poll asks, in rank order: a formation's while one is under way."""
        state = self.state
        return state.formation.members if isinstance(state, Forming) else self.members

    def _on_shard_written(self, obs: ShardWritten, now: float) -> list[Action]:
        self.stall.progressed(now)  # a slow upload holds the run up; it is not a hang
        return []

    def _on_polled(self, obs: ProbesRead, now: float) -> list[Action]:
        """The answers to a poll, read by the detectors in turn: a member lost to the network
        explains the others' stall (they wait on it), so nobody else is judged in that poll."""
        poll = self.stall.answered(now)
        if poll is None:
            return []
        finding = (self._reach.read(poll, obs.answers, self._by_status[Status.GONE], now)
                   or self._partition.read(poll, self._watched(), obs.answers, now))
        if finding is None and poll.hang:
            state = self.state
            finding = self._hang.read(poll, obs.answers, state if isinstance(state, Forming) else None)
        return [] if finding is None else self.step(finding, now)

    def _on_unreachable(self, obs: Unreachable, now: float) -> list[Action]:
        """Each unreachable member is lost now, like a death, so the heal releases the members
        waiting on it; it is killed too, and nothing it sends later counts (`fenced`)."""
        actions: list[Action] = []
        for worker_id in obs.workers:
            # A replica's mate lost with one before it is gone already.
            if self.workers[worker_id].status == Status.GONE or isinstance(self.state, TERMINAL):
                continue
            self._stood_still(obs.stalled_since, obs.detect_s)
            actions += self._give_up(worker_id, "unreachable", obs.cause, now, detect_s=obs.detect_s)
        return actions

    def _on_cut_off(self, obs: CutOff, now: float) -> list[Action]:
        """The members cut off by a partial partition are lost now, like unreachable members."""
        self._stood_still(obs.stalled_since, obs.detect_s)
        actions = [self._decision("EVICT", obs.reason)]
        for worker_id in obs.workers:
            actions += self._give_up(worker_id, "cut_off", obs.cause, now, detect_s=obs.detect_s)
        return actions

    def _on_hung(self, obs: Hung, now: float) -> list[Action]:
        actions: list[Action] = []
        for worker_id, why in obs.causes.items():
            actions += self._give_up(worker_id, "hang", why, now, detect_s=obs.detect_s, deadline_s=obs.deadline_s)
        return actions

    def _on_deadlocked(self, obs: Deadlocked, now: float) -> list[Action]:
        """Every member waits in a collective the others never complete: a bug in the train loop
        (a collective some ranks skip, or call with other shapes), counted as an application error."""
        self.failures += 1
        decision = policies.decide_failure("app_error", self.failures, self.failure.max_failures)
        actions: list[Action] = [self._decision(decision.action, decision.reason)]
        if decision.action == "RAISE":
            return actions + self._enter(Failed(obs.cause, "app_error"), decision.reason)
        for worker_id in self.members:
            actions += self._evict(worker_id, "app_error", obs.cause)
        return actions

    def _on_straggling(self, obs: Straggling, now: float) -> list[Action]:
        """Evicted only from a running generation: a formation under way already changes the membership."""
        if not isinstance(self.state, Running):
            return []
        record = self.workers[obs.worker_id]
        if record.status != Status.MEMBER or record.evicted_for:
            return []
        return [self._decision("EVICT", f"worker {obs.worker_id} is a straggler: {obs.reason}"),
                *self._give_up(obs.worker_id, "straggler", obs.reason, now)]

    def _stood_still(self, stalled_since: float, detect_s: float) -> None:
        """A member is lost for a stall a poll found: the survivors stood still since the last
        progress, so the recovery counts from there, and the stall went unseen for `detect_s`."""
        self.failure_at = min(self.failure_at or stalled_since, stalled_since)
        self.detect_s = max(self.detect_s, detect_s)

    # --- decisions --------------------------------------------------------------------------
    def _reconcile(self, now: float) -> list[Action]:
        """Offer the membership the policies want, if no formation is under way."""
        if isinstance(self.state, (Preparing, Forming, Finishing, *TERMINAL)):
            return []
        idle_count = len(self._by_status[Status.IDLE])
        starting = bool(self._by_status[Status.STARTING])
        if self.running < 0 and not self.members and starting and self.first_ready_at is not None \
                and now - self.first_ready_at < self.scaling.start_grace_s and idle_count < self.scaling.max_workers:
            return []  # the first generation waits briefly for workers starting alongside
        # A heal around a between-steps block takes the live members alone, even below min_workers:
        # they finish the block, and the newcomers join in the grow that follows.
        alone = self.heal_without_newcomers and self.broken and bool(self.members)
        min_workers = 1 if alone else self.scaling.min_workers
        if isinstance(self.state, Waiting) and len(self.members) + idle_count < min_workers:
            # Too few could run whichever the policy picked: still waiting. Said before the
            # policy looks at every ready worker, which each of thousands arriving would pay.
            return []
        idle = [] if alone else sorted(self._by_status[Status.IDLE])
        ready = [w for w in idle if all(self.workers[m].status == Status.IDLE for m in self._replica_of(w))]
        decision = policies.decide_membership(self.members, ready, self.broken or not self.members,
                                              min_workers, self.scaling.max_workers, self.scaling.replica_size)
        if isinstance(decision, policies.WaitDecision):
            if isinstance(self.state, Waiting):
                return []
            deadline = now + self.failure.capacity_timeout_s
            return self._enter(Waiting(now, deadline, decision.reason), decision.reason)
        if isinstance(decision, policies.NoopDecision):
            return []
        members = decision.members
        restart = not any(self.workers[w].holds_state for w in members)
        if restart:
            reason = Reason.START if self.running < 0 else Reason.RESTART
        else:
            reason = Reason.HEAL if self.broken else Reason.GROW
        if (reason == Reason.GROW and self.max_steps is not None
                and self.committed_step + PREPARE_SLACK_STEPS + 1 >= self.max_steps):
            return []
        self.generation += 1
        since = self.failure_at if reason in (Reason.HEAL, Reason.RESTART) and self.failure_at else now
        formation = Formation(self.generation, tuple(members), reason, decision.reason, since, decided_at=now)
        self._unforgotten[formation.generation] = len(members)
        self.stall.progressed(now)
        if reason == Reason.GROW:
            return [Prepare(formation.generation, self.members), *self._enter(Preparing(formation), decision.reason)]
        return [self._offer(formation, restart), *self._enter(Forming(formation), decision.reason)]

    def _offer(self, formation: Formation, restart: bool = False) -> Offer:
        # Members that were not in the running generation: a restart that loses part of the run's state
        # still takes the members in it (some inside a between-steps block) beside newcomers.
        newcomers = bool(self.members) and any(self._rank(w) is None for w in formation.members)
        # The derived deadline was measured on gloo only; NCCL's first collective also creates its
        # communicator under the group's timeout, which has not run under a fraction of a second.
        if self.scaling.backend != "gloo":
            return Offer(formation, restart, newcomers=newcomers)
        deadline = policies.connect_deadline(self.connect_s, self.failed_formations, self.failure.connect_floor_s)
        return Offer(formation, restart, deadline, newcomers)

    def _commit(self, formation: Formation, acked: dict[int, FormedReport], now: float) -> list[Action]:
        old_size, self.running_size = self.running_size, len(formation.members)
        heal = formation.reason in (Reason.HEAL, Reason.RESTART)
        # The phases that stopped training are those of the members that were training: a
        # newcomer's or a spare's wait at the barrier stops nobody.
        holders = [r for w, r in acked.items() if self.workers[w].holds_state] or list(acked.values())
        self.running, self.members, self.broken = formation.generation, formation.members, False
        self.failed_formations = 0
        self.heal_without_newcomers = False
        self.stall.progressed(now)
        self.committed_at_step = self.committed_step
        for worker_id in formation.members:
            self._move(self.workers[worker_id], Status.MEMBER)
            self.workers[worker_id].holds_state = True
        first = acked[formation.members[0]]
        phases = {k: max(r.timings.get(k, 0.0) for r in holders) for k in ("leave_s", "barrier_s", "connect_s", "sync_s")}
        self.connect_s = max(r.timings.get("connect_s", 0.0) for r in acked.values())
        actions: list[Action] = [Emit("generation_formed", {
            "generation": formation.generation, "world_size": len(formation.members), "kind": formation.reason.value,
            "reason": formation.detail, "seconds": now - formation.since, "source_rank": first.source_rank,
            "step": first.step, "switch_step": formation.switch_step,
            # The running members' pause: from leaving the old group to training in the new one.
            "pause_s": max(sum(r.timings.values()) for r in holders), **phases,
            "members": [{"worker_id": w, "pid": self.workers[w].pid, "node": self.workers[w].node}
                        for w in formation.members],
        })]
        stale = tuple((g, size) for g, size in self._unforgotten.items() if g < formation.generation)
        if stale:
            actions.append(Forget(stale))
            for generation, _ in stale:
                del self._unforgotten[generation]
        if old_size and old_size != len(formation.members):
            actions.append(Emit("rescale", {"generation": formation.generation, "from_size": old_size,
                                            "to_size": len(formation.members), "reason": formation.detail}))
        if heal and self.failure_at is not None:
            rolled_back = max(0, self.committed_step - first.step)
            actions.append(Emit("recovery", {
                "generation": formation.generation, "seconds": now - self.failure_at,
                "decide_s": formation.decided_at - self.failure_at, **phases,
                "steps_lost": max(rolled_back, *(r.steps_lost for r in acked.values())),
                "world_size": len(formation.members), "from_checkpoint": formation.reason == Reason.RESTART,
                "detect_s": self.detect_s,
            }))
        self.failure_at, self.detect_s = None, 0.0  # a grow that commits after a break took the broken members in too
        if formation.reason == Reason.RESTART:
            # Back at a checkpoint: the steps it replays are progress again, for the crash-loop bound.
            self.committed_step = self.committed_at_step = first.step
        return actions + self._enter(Running(formation.generation), formation.detail) + self._reconcile(now)

    def _lose(self, worker_id: int, now: float) -> list[Action]:
        """A worker is gone: abort a formation it was in, heal the generation it was in."""
        record = self.workers[worker_id]
        self._move(record, Status.GONE)
        self._note_node_failure(record.node, now)
        actions: list[Action] = []
        if isinstance(self.state, Finishing):
            return self._maybe_finished(worker_id)
        actions += self._release_replica_of(worker_id)
        state = self.state
        if isinstance(state, (Preparing, Forming)) and worker_id in state.formation.ranks:
            actions += self._abort_formation(now)
        rank = self._rank(worker_id)
        if rank is not None:
            self.members = self.members[:rank] + self.members[rank + 1:]
            if not self.broken:
                actions += self._break(now)
                if isinstance(self.state, Failed):
                    return actions
            if not self.members:
                self.failures += 1
                decision = policies.decide_failure("all_lost", self.failures, self.failure.max_failures)
                actions.append(self._decision(decision.action, decision.reason))
                if decision.action == "RAISE":
                    message = f"every worker was lost (the last: worker {worker_id}); {decision.reason}"
                    return actions + self._enter(Failed(message, "all_lost"), decision.reason)
        return actions + self._top_up() + self._reconcile(now)

    def _release_replica_of(self, worker_id: int) -> list[Action]:
        """A replica cannot run without any one of its workers: the rest of a lost worker's replica
        leaves with it, and a new replica forms when capacity for a whole one is back."""
        actions: list[Action] = []
        for mate in self._replica_of(worker_id):
            record = self.workers[mate]
            if mate == worker_id or record.status == Status.GONE:
                continue
            if not record.evicted_for:  # one the controller already killed (hung, say) is not killed twice
                why = f"worker {worker_id} of its replica was lost; a replica trains only whole"
                actions += [self._worker_failed(mate, "replica", why), Kill(mate)]
                record.evicted_for = "replica"
            self._move(record, Status.GONE)
            self.members = tuple(w for w in self.members if w != mate)
        return actions

    def _replica_of(self, worker_id: int) -> range:
        """The workers of `worker_id`'s replica: workers are started in whole replicas, with consecutive ids."""
        size = self.scaling.replica_size
        first = worker_id // size * size
        return range(first, first + size)

    def _formation_advice(self) -> str:
        """What to check when generations keep failing to form, from the run's own configuration."""
        gpu = self.scaling.worker_resources().get("GPU", 0)
        if self.scaling.use_gpu and 0 < gpu < 1:
            return (f"Each worker asks for GPU={gpu:g}, so Ray puts {int(1 // gpu)} workers on one GPU, and NCCL refuses "
                    "two ranks of a group on the same GPU unless each is a host of its own to it (elastic sets a "
                    "distinct NCCL_HOSTID per worker: see the shared_gpu warning): give each worker a whole GPU "
                    "(resources_per_worker GPU=1), or try the run on CPUs (use_gpu=False, gloo).")
        return "Check that workers can reach each other and the controller's TCPStore."

    def _break(self, now: float) -> list[Action]:
        """The running generation broke. Generations in a row that break before committing a
        step are a crash loop (the same step keeps failing), which fails the run past its limit."""
        self.broken = True
        self.failure_at = self.failure_at or now
        if self.committed_step == self.committed_at_step:
            self.heals_without_step += 1
        limit = self.failure.max_heals_without_step
        if self.heals_without_step <= limit:
            return []
        message = (f"{self.heals_without_step} generations in a row broke before committing a step, more than "
                   f"FailureConfig(max_heals_without_step={limit}): the same step keeps failing (a crash loop, or a "
                   "collective the train loop calls differently on different ranks). Fix the train loop or the "
                   "failing nodes.")
        return self._enter(Failed(message, "crash_loop"), "crash loop")

    def _form_again(self, action: str, reason: str, now: float) -> list[Action]:
        """Give up the formation under way and decide anew (`action`, journaled with `reason`): its
        members may have left the running generation already, so the run heals."""
        actions = [self._decision(action, reason), *self._abort_formation(now)]
        self.broken = True
        self.failure_at = self.failure_at or now
        return actions + self._reconcile(now)

    def _abort_formation(self, now: float) -> list[Action]:
        state = self.state
        assert isinstance(state, (Preparing, Forming))
        formation = state.formation
        live = tuple(itertools.filterfalse(self._by_status[Status.GONE].__contains__, formation.members))
        if isinstance(state, Forming) and formation.reason == Reason.GROW:
            # Members may already have left the running generation at the switch step: it
            # must be healed, or they would wait for an offer forever.
            self.broken = True
            self.failure_at = self.failure_at or now
        if self.running >= 0:
            self.state = Running(self.running)
        else:
            self.state = Waiting(now, now + self.failure.capacity_timeout_s, "the first generation was aborted")
        return [Abort(formation.generation, live),
                Emit("state", {"state": "ABORTED", "generation": formation.generation,
                               "reason": f"generation {formation.generation} aborted before it committed"})]

    def _evict(self, worker_id: int, kind: str, why: str, **fields: float) -> list[Action]:
        """Kill a live worker; its death then heals like any other."""
        record = self.workers[worker_id]
        record.evicted_for = kind
        return [self._worker_failed(worker_id, kind, why, **fields), Kill(worker_id)]

    def _give_up(self, worker_id: int, kind: str, why: str, now: float, **fields: float) -> list[Action]:
        """Evict a member and lose it at once, as a death: the heal's offer goes out now, without
        it, and releases whoever waits on it. Waiting for its kill to land first would leave it in
        the membership meanwhile, and a formation offered then (a survivor's broken collective
        asks for one) would wait on it."""
        return self._evict(worker_id, kind, why, **fields) + self._lose(worker_id, now)

    def _maybe_finished(self, ended: int) -> list[Action]:
        """`ended` is gone while the run finishes: finished, once no member is left running."""
        state = self.state
        assert isinstance(state, Finishing)
        state.ending.discard(ended)
        if state.ending:
            return []
        return self._enter(Finished(), "every member ended its train loop")

    def _top_up(self) -> list[Action]:
        """Request workers until live ones reach max_workers plus the warm spares."""
        live = len(self.workers) - len(self._by_status[Status.GONE])
        # A lost replica goes whole (`_release_replica_of`), so this requests whole replicas.
        count = policies.workers_to_start(live, self.scaling.max_workers + self.scaling.spare_workers)
        ids = tuple(range(len(self.workers), len(self.workers) + count))
        for worker_id in ids:
            self.workers[worker_id] = WorkerRecord(worker_id)
            self._by_status[Status.STARTING].add(worker_id)
        return [StartWorkers(ids)] if ids else []

    def _note_node_failure(self, node: str, now: float) -> None:
        if node:
            self.node_failures.setdefault(node, []).append(now)

    # --- helpers ----------------------------------------------------------------------------
    def _move(self, record: WorkerRecord, status: Status) -> None:
        self._by_status[record.status].discard(record.worker_id)
        self._by_status[status].add(record.worker_id)
        record.status = status

    def _rank(self, worker_id: int) -> int | None:
        """`worker_id`'s rank in the running generation, None if it is no member. The index is
        rebuilt when `members` changes (a commit, a loss): a lookup costs O(1), not O(W)."""
        members, ranks = self._ranked
        if members is not self.members:
            ranks = dict(zip(self.members, range(len(self.members))))
            self._ranked = (self.members, ranks)
        return ranks.get(worker_id)

    def _enter(self, state: ControllerState, reason: str) -> list[Action]:
        self.state = state
        return [Emit("state", {"state": state.name, "reason": reason, "generation": self.generation})]

    def _decision(self, action: str, reason: str) -> Emit:
        return Emit("decision", {"action": action, "reason": reason, "failures": self.failures})

    def _worker_failed(self, worker_id: int, kind: str, cause: str, **fields: float | str) -> Emit:
        record = self.workers[worker_id]
        rank = self._rank(worker_id)
        return Emit("worker_failed", {"worker_id": worker_id, "rank": rank, "node": record.node, "pid": record.pid,
                                      "kind": kind, "cause": cause, "generation": self.running, **fields})


# Each observation's handler, found once per observation: a heal at 10,000 workers is 20,000 of them.
_HANDLERS = {
    WorkerReady: Protocol._on_ready, WorkerExited: Protocol._on_exited, GroupBroken: Protocol._on_broken,
    SwitchPrepared: Protocol._on_prepared, FormedReport: Protocol._on_formed, Tick: Protocol._on_tick,
    StepCommitted: Protocol._on_step_committed, ProbesRead: Protocol._on_polled,
    ShardWritten: Protocol._on_shard_written,
    # The detectors' findings.
    Straggling: Protocol._on_straggling, Unreachable: Protocol._on_unreachable, CutOff: Protocol._on_cut_off,
    Hung: Protocol._on_hung, Deadlocked: Protocol._on_deadlocked,
}
