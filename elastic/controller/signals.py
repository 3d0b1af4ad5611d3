"""What the controller observes and what it does: typed messages between the protocol
(`elastic.controller.protocol`, pure) and the controller actor that carries its actions out with Ray.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from elastic.controller.policies import CONNECT_CEILING_S
from elastic.controller.states import Formation, Reason

# --- observations ---------------------------------------------------------------------


class Exit(enum.Enum):
    FINISHED = "finished"  # the train loop returned
    APP_ERROR = "app_error"  # the train loop raised: a bug in the user's code
    DIED = "died"  # the process is gone (Ray's outstanding call on it failed)
    EVICTED = "evicted"  # the controller closed its mailbox; it stopped


@dataclass(frozen=True)
class WorkerReady:
    """A worker's train loop waits to join its first generation."""

    worker_id: int
    node: str
    pid: int
    host: str = ""
    binds: str = ""  # the address its collective groups bind (elastic.comm.binding)


@dataclass(frozen=True)
class WorkerExited:
    worker_id: int
    exit: Exit
    cause: str = ""
    step: int = 0
    traceback: str = ""
    value: Any = None
    model: Any = None  # a finished rank 0's whole model (TrainContext.final_model)


@dataclass(frozen=True)
class GroupBroken:
    """A member's collective failed: it left `generation` and waits for a newer one."""

    worker_id: int
    generation: int


@dataclass(frozen=True)
class SwitchPrepared:
    """A running member's answer to a prepare: the step it is at."""

    worker_id: int
    generation: int
    step: int


@dataclass(frozen=True)
class FormedReport:
    """A member's outcome of joining `generation`."""

    worker_id: int
    generation: int
    ok: bool
    step: int = 0
    source_rank: int = 0
    steps_lost: int = 0
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    state_lost: bool = False  # the run's live state is gone (a ZeRO shard without a holder)
    checkpointed: bool = False  # a complete checkpoint exists to restart from (the controller's knowledge)
    # Declined: the member heals from inside a between-steps block, which it runs again next, and
    # the generation takes in a newcomer, which begins at the next step and could not run it.
    in_block: bool = False


@dataclass(frozen=True)
class Tick:
    """Time passes. `last_step_at`: when the newest committed step was reported;
    `deadline_s`: how long the run may go without one (from measured step times), the hang
    deadline; `reach_deadline_s`: how long before the members are pinged for one that is
    unreachable. The protocol's `detectors.StallWatch` turns them into polls."""

    last_step_at: float = 0.0
    deadline_s: float = float("inf")
    reach_deadline_s: float = float("inf")


@dataclass(frozen=True)
class StepCommitted:
    """The members committed `step` (their step reports, or a fault fired at it): the run makes
    progress, which ends a crash loop's count."""

    step: int


@dataclass(frozen=True)
class ShardWritten:
    """A rank finished uploading a checkpoint shard: progress, though no step committed."""

    worker_id: int
    step: int


@dataclass(frozen=True)
class ProbeReading:
    """Where a member's train thread is, from its hang probe (`elastic.worker.probe.HangProbe`)."""

    step: int
    entered_sync: int
    launched: int
    arrived: int  # the newest generation whose barrier it reached
    checkpointing: bool  # waiting for its checkpoint upload
    blocked_in: str = ""  # the torch.distributed call its train thread waits in, if any
    connected: int = -1  # the newest generation whose groups it connected
    address: str = ""  # its node's address, as its peers' connections see it
    # Per peer address: how long data its connections sent there has gone unacknowledged while the
    # kernel retransmits it (`elastic.comm.links.LinkHealth.silent`)
    silent: dict[str, float] = field(default_factory=dict)

    @property
    def connecting(self) -> bool:
        """Past a barrier's "go", connecting that generation's groups: waiting on its peers, for at
        most its connect deadline (a peer that died right after the barrier), never hung."""
        return self.arrived > self.connected


@dataclass(frozen=True)
class ProbesRead:
    """Each polled member's probe reading; None when it did not answer in time."""

    answers: dict[int, ProbeReading | None]


# --- findings: what a detector (`elastic.controller.detectors`) makes of time and readings --------


@dataclass(frozen=True)
class Straggling:
    """A member to evict as a straggler (`detectors.StragglerCheck`), with the reason."""

    worker_id: int
    reason: str


@dataclass(frozen=True)
class Unreachable:
    """Members that answered no ping (`detectors.ReachCheck`). The run stood still from
    `stalled_since` (its last progress), and `detect_s` went by before it was seen."""

    workers: tuple[int, ...]
    cause: str
    stalled_since: float
    detect_s: float


@dataclass(frozen=True)
class CutOff:
    """Members that answer the controller but whose links to their peers are cut, a partial
    partition (`detectors.PartitionCheck`): `reason` for the decision, `cause` for each member."""

    workers: tuple[int, ...]
    reason: str
    cause: str
    stalled_since: float
    detect_s: float


@dataclass(frozen=True)
class Hung:
    """Members behind their peers past the hang deadline (`detectors.HangCheck`), each with why."""

    causes: dict[int, str]
    detect_s: float
    deadline_s: float


@dataclass(frozen=True)
class Deadlocked:
    """Every member waits past the hang deadline in a collective the others never complete
    (`detectors.HangCheck`): a bug in the train loop, not a fault."""

    cause: str


Observation = (WorkerReady | WorkerExited | GroupBroken | SwitchPrepared | FormedReport | Tick | StepCommitted
               | ProbesRead | ShardWritten | Straggling | Unreachable | CutOff | Hung | Deadlocked)

# --- actions ----------------------------------------------------------------------------

# Steps a rank may start after answering a prepare before it waits for the commit: the
# protocol commits a switch step this far past every answer (`elastic.worker.mailbox` waits).
PREPARE_SLACK_STEPS = 2


@dataclass(frozen=True)
class StartWorkers:
    worker_ids: tuple[int, ...]


@dataclass(frozen=True)
class Prepare:
    generation: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class Offer:
    """Send each member its spec of `formation`; `restart`: nobody holds live state;
    `connect_timeout_s`: how long its members may take to connect its groups."""

    formation: Formation
    restart: bool = False
    connect_timeout_s: float = CONNECT_CEILING_S
    newcomers: bool = False  # some member was not in the running generation (a spare, a replacement)


@dataclass(frozen=True)
class Abort:
    """Cancel `generation`: its barrier key, and each worker's pending prepare or offer."""

    generation: int
    workers: tuple[int, ...]


@dataclass(frozen=True)
class Forget:
    """Delete the store keys of these (generation, world size): a later generation committed, so
    no member reads them again."""

    generations: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Kill:
    worker_id: int


@dataclass(frozen=True)
class ReadProbes:
    """Ask these members for their probe readings (answered as `ProbesRead`)."""

    members: tuple[int, ...]


@dataclass(frozen=True)
class Emit:
    type: str
    fields: dict[str, Any]


Action = StartWorkers | Prepare | Offer | Abort | Forget | Kill | ReadProbes | Emit


def coalesce(actions: list[Action]) -> list[Action]:
    """What the actions of one batch of observations come to: a generation first announced in
    the batch (its prepare, or the offer of a formation that needs none) and aborted later in the
    same batch is never sent, nor its abort to the workers; its barrier key is still set.

    A wave of deaths otherwise offers a heal to every survivor per death, each offer aborted by
    the next death: W calls a death. The controller steps the protocol through every observation
    that queued while it carried out the last batch (a 10,000-worker offer takes seconds), so a
    wave's deaths after the first come in one batch and one offer (docs/architecture.md, "Scale,
    on paper")."""
    announced: set[int] = set()
    withdrawn: set[int] = set()
    for action in actions:
        if isinstance(action, Abort) and action.generation in announced:
            withdrawn.add(action.generation)
        elif isinstance(action, Prepare) or (isinstance(action, Offer) and action.formation.reason != Reason.GROW):
            announced.add(_generation(action))
    kept: list[Action] = []
    for action in actions:
        if isinstance(action, Abort) and action.generation in withdrawn:
            kept.append(Abort(action.generation, ()))
        elif not (isinstance(action, (Prepare, Offer)) and _generation(action) in withdrawn):
            kept.append(action)
    return kept


def _generation(action: Prepare | Offer) -> int:
    return action.generation if isinstance(action, Prepare) else action.formation.generation
