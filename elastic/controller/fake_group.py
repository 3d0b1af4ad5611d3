"""A fake worker group: the workers' side of the protocol, in memory, without Ray.

`FakeWorkerGroup` carries out the protocol's actions (it records offers, prepares, aborts, kills
and polls) and feeds back what real workers would report, through hooks such as `die(w)`,
`form(g)` and `answer_prepare(...)`. `tests/test_protocol.py` advances the protocol with it one
observation at a time; `benchmarks/scale.py --simulated` drives it with thousands of workers and
times the protocol's share (`deliver`).
"""

from __future__ import annotations

from collections.abc import Iterable

from elastic.config import FailureConfig, ScalingConfig
from elastic.controller.protocol import Protocol
from elastic.controller.signals import (
    Abort, Action, Emit, Exit, FormedReport, Kill, Observation, Offer, ReadProbes, Prepare, StartWorkers, StepCommitted,
    SwitchPrepared, Tick, WorkerExited, WorkerReady, coalesce,
)

MAX_STEPS = 1000


def death(worker_id: int) -> WorkerExited:
    """What the controller observes when a worker's process dies."""
    return WorkerExited(worker_id, Exit.DIED, "ActorDiedError: worker process died")


class FakeWorkerGroup:
    """The workers' side of the protocol, in memory. Each observation arrives `after_s` (fake
    seconds) after the one before."""

    def __init__(self, min_workers=2, max_workers=3, spare_workers=0, max_steps=MAX_STEPS, pipeline_stages=1,
                 start_grace_s=None, **failure):
        grace = {} if start_grace_s is None else {"start_grace_s": start_grace_s}
        self.protocol = Protocol(
            ScalingConfig(min_workers=min_workers, max_workers=max_workers, spare_workers=spare_workers,
                          pipeline_stages=pipeline_stages, **grace),
            FailureConfig(**failure), max_steps,
        )
        self.now = 100.0
        self.actions: list[Action] = []
        self.offers: dict[int, Offer] = {}
        self.prepares: dict[int, Prepare] = {}
        self.aborted: list[int] = []
        self.killed: list[int] = []
        self.polls: list[ReadProbes] = []
        self.started: list[int] = []
        self._carry(self.protocol.start(self.now))

    # --- what happens to workers --------------------------------------------------------
    def send(self, observation: Observation, after_s: float = 0.01) -> list[Action]:
        return self.deliver([observation], after_s)

    def deliver(self, observations: Iterable[Observation], after_s: float = 0.01) -> list[Action]:
        """Step the protocol through `observations` in order and carry out, as the controller does
        one batch (`coalesce`), what it did; its actions, before coalescing.

        Nothing but the protocol's own steps runs between two observations, so a benchmark that
        builds them first and times this call times the controller's decisions."""
        step, actions = self.protocol.step, []
        for observation in observations:
            self.now += after_s
            actions += step(observation, self.now)
        self._carry(coalesce(actions))
        return actions

    def ready(self, *worker_ids: int, after_s: float = 0.01) -> list[Action]:
        return self.deliver([WorkerReady(w, node=f"node-{w}", pid=1000 + w) for w in worker_ids], after_s)

    def die(self, worker_id: int) -> list[Action]:
        return self.send(death(worker_id))

    def raise_error(self, worker_id: int) -> list[Action]:
        return self.send(WorkerExited(worker_id, Exit.APP_ERROR, "ValueError: bug", traceback="tb"))

    def finish(self, worker_id: int, value=None) -> list[Action]:
        return self.send(WorkerExited(worker_id, Exit.FINISHED, step=self.protocol.max_steps, value=value))

    def formed_reports(self, generation: int | None = None, members: Iterable[int] | None = None,
                       step: int = 0) -> list[FormedReport]:
        """What every (or the given) member of `generation` (the latest offered) reports once it formed."""
        generation = self.latest_offer.formation.generation if generation is None else generation
        return [FormedReport(w, generation, ok=True, step=step, timings={"sync_s": 0.01})
                for w in members or self.offers[generation].formation.members]

    def form(self, generation: int | None = None, members: Iterable[int] | None = None, step: int = 0,
             after_s: float = 0.01) -> list[Action]:
        """Every (or the given) member of `generation` (the latest offered) reports it formed."""
        return self.deliver(self.formed_reports(generation, members, step), after_s)

    def commit_step(self, step: int) -> list[Action]:
        """The members committed `step`: its report arrives with no time passing, as training goes on."""
        return self.send(StepCommitted(step), after_s=0.0)

    def answer_prepare(self, steps: dict[int, int], after_s: float = 0.01) -> list[Action]:
        generation = max(self.prepares)
        return self.deliver([SwitchPrepared(w, generation, step) for w, step in steps.items()], after_s)

    def start_run(self, *worker_ids: int, after_s: float = 0.01) -> None:
        """Start workers, form the first generation and commit it."""
        self.ready(*worker_ids, after_s=after_s)
        if not self.offers:
            self.send(Tick(), after_s=self.protocol.scaling.start_grace_s + 0.1)
        self.form(after_s=after_s)

    # --- what the protocol did ------------------------------------------------------------
    @property
    def state(self) -> str:
        return self.protocol.state.name

    @property
    def latest_offer(self) -> Offer:
        return self.offers[max(self.offers)]

    def events(self, type: str) -> list[dict]:
        return [a.fields for a in self.actions if isinstance(a, Emit) and a.type == type]

    def _carry(self, actions: list[Action]) -> None:
        self.actions += actions
        for action in actions:
            if isinstance(action, Offer):
                self.offers[action.formation.generation] = action
            elif isinstance(action, Prepare):
                self.prepares[action.generation] = action
            elif isinstance(action, Abort):
                self.aborted.append(action.generation)
            elif isinstance(action, Kill):
                self.killed.append(action.worker_id)
            elif isinstance(action, ReadProbes):
                self.polls.append(action)
            elif isinstance(action, StartWorkers):
                self.started += action.worker_ids
