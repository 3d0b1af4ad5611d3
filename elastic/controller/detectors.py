"""The detectors: small objects that turn time, probe readings and step reports into findings.

None of them acts, and none touches Ray or reads a clock: time is passed in. Each returns a
finding (an observation of `elastic.controller.signals`) or None, and the protocol
(`elastic.controller.protocol`) reacts to the finding alone, as Ray Train v2's controller reacts
to its policies' decisions:

- `StallWatch`: when to poll the members. Past the reach deadline it pings them; past the hang
  deadline the poll judges them too. The only one with state: when the run last made progress,
  when it was last pinged, and the poll under way.
- `ReachCheck`: a poll's members that answered no ping (`Unreachable`).
- `PartitionCheck`: members that all answer but whose links are cut, a partial partition (`CutOff`).
- `HangCheck`: members behind their peers past the hang deadline (`Hung`), or every member
  waiting in a collective the others never complete (`Deadlocked`).
- `StragglerCheck`: a member slow to compute, or on a slow link, step after step (`Straggling`).

docs/architecture.md ("Hangs, stragglers, crash loops" and "The network") explains each rule.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from elastic.controller import policies
from elastic.controller.signals import CutOff, Deadlocked, Hung, ProbeReading, Straggling, Unreachable
from elastic.controller.states import Forming

Answers = dict[int, ProbeReading | None]  # each polled member's reading; None: no answer in time


@dataclass(frozen=True)
class Poll:
    """One poll of the members: sent at `sent_at`, about the stall since `stalled_since`; `hang`:
    past the hang deadline `deadline_s`, so it judges the members, not only pings them."""

    sent_at: float
    stalled_since: float
    hang: bool
    deadline_s: float

    @property
    def stalled_s(self) -> float:
        """How long the run had gone without progress when it was polled."""
        return self.sent_at - self.stalled_since


@dataclass
class StallWatch:
    """When to poll the members, from the time since the last progress.

    Progress is a committed step (the tick's `last_step_at`) or another sign (`progressed`): an
    offer, a commit, a checkpoint shard written, a hang judgement. A ping short of the hang
    deadline is no progress: a member that answers is left alone until the hang deadline, which
    the ping never postpones."""

    progress_at: float = 0.0  # the last sign of progress other than a committed step
    pinged_at: float = 0.0  # when the members were last polled
    pending: Poll | None = None  # the poll whose answers are awaited: at most one at a time

    def progressed(self, now: float) -> None:
        self.progress_at = now

    def tick(self, now: float, last_step_at: float, hang_deadline_s: float, reach_deadline_s: float) -> Poll | None:
        """The poll to send now, if one is due and none is under way."""
        if self.pending is not None:
            return None
        stalled_since = max(last_step_at, self.progress_at)
        hang = now - stalled_since > hang_deadline_s
        if not hang and now - max(stalled_since, self.pinged_at) <= reach_deadline_s:
            return None
        self.pinged_at = now
        self.pending = Poll(now, stalled_since, hang, hang_deadline_s)
        return self.pending

    def answered(self, now: float) -> Poll | None:
        """The poll the answers arriving now are for; None when none was asked."""
        poll, self.pending = self.pending, None
        if poll is not None and poll.hang:
            self.progress_at = now  # a judgement starts the stall clock again: the next is a whole deadline away
        return poll


@dataclass(frozen=True)
class ReachCheck:
    """Members that answered no ping are unreachable: dead, or alive behind a link that is down.
    Ray itself would call their node dead only after about a minute of failed health checks.

    A poll that no member answered blames nobody: a partition is told from the controller's own
    starvation (a loaded machine, its own link down) by the members that still answer. The next
    poll asks again, and a lone member behind a cut link waits for Ray's word."""

    ping_timeout_s: float

    def read(self, poll: Poll, answers: Answers, gone: Container[int], now: float) -> Unreachable | None:
        """`gone`: the workers already lost (one that died while the poll was out), never blamed."""
        if all(answer is None for answer in answers.values()):
            return None
        silent = tuple(w for w, answer in answers.items() if answer is None and w not in gone)
        if not silent:
            return None
        cause = f"answered no ping within FailureConfig(ping_timeout_s={self.ping_timeout_s})"
        return Unreachable(silent, cause, poll.stalled_since, now - poll.stalled_since)


@dataclass(frozen=True)
class PartitionCheck:
    """Members that answer the controller but whose peers' links are cut (a partial partition):
    every rank waits in a collective, nobody is dead or behind, so no other check decides. The
    kernel's word on each rank's connections (`ProbeReading.silent`) names the cut links, and the
    smallest set of members that explains them (`policies.find_cut_off`) is cut off; the members
    merely waiting on them never are."""

    link_silence_s: float

    def read(self, poll: Poll, order: Sequence[int], answers: Answers, now: float) -> CutOff | None:
        """`order`: the polled members in rank order (find_cut_off keeps the lowest ranks)."""
        if any(answer is None for answer in answers.values()):
            return None
        answered = [w for w in order if w in answers]
        addresses = {w: answers[w].address for w in answered}
        silent = {w: answers[w].silent for w in answered}
        cut = policies.find_cut_off(addresses, silent, self.link_silence_s)
        if not cut or len(cut) == len(answered):
            return None  # nobody is cut, or everyone is, which names no culprit
        cut_addresses = {addresses[w] for w in cut}
        links = sorted({(addresses[w], peer) for w in answered for peer, seconds in silent[w].items()
                        if seconds >= self.link_silence_s
                        and (addresses[w] in cut_addresses) != (peer in cut_addresses)})
        shown = ", ".join(f"{source} -> {peer}" for source, peer in links)
        reason = (f"workers {cut} are cut off from their peers ({shown}) while every member answers the "
                  "controller: a partial partition, healed around them")
        cause = (f"its links to its peers carried no acknowledgement for FailureConfig(link_silence_s="
                 f"{self.link_silence_s}) or longer ({shown}): cut off by the network")
        return CutOff(tuple(cut), reason, cause, poll.stalled_since, now - poll.stalled_since)


@dataclass(frozen=True)
class HangCheck:
    """Past the hang deadline, the members behind their peers are hung: a hung rank never
    reaches the sync its peers wait in (`policies.find_hung`). Never hung: a member waiting for
    its checkpoint upload (progress, not a hang), one connecting a generation past its barrier
    (its connect deadline ends the wait), and in a formation one at its barrier."""

    hang_ceiling_s: float

    def read(self, poll: Poll, answers: Answers, forming: Forming | None) -> Hung | Deadlocked | None:
        """`forming`: the formation under way, if any, whose barrier some members wait at."""
        if any(answer is not None and answer.checkpointing for answer in answers.values()):
            return None
        suspects = {w: p for w, p in answers.items() if p is not None and not p.connecting}
        if forming is not None:
            # Those at the barrier wait for the others; only the ones that never came can be hung.
            suspects = {w: p for w, p in suspects.items()
                        if w not in forming.acked and p.arrived < forming.formation.generation}
        if not suspects:
            return None
        hung = policies.find_hung({w: (p.step, p.entered_sync, p.launched) for w, p in suspects.items()})
        # In a formation, the members that never came are the culprits even when alike: a
        # formation takes milliseconds once everyone is there. In a running generation, alike
        # members that all answer may just be in a long evaluation.
        if forming is None and set(hung) == set(suspects):
            blocked = sorted({p.blocked_in for p in suspects.values()})
            if all(blocked):
                return Deadlocked(
                    f"every rank has waited {poll.stalled_s:.1f} s in a collective, past the hang deadline of "
                    f"{poll.deadline_s:.1f} s: {'; '.join(blocked)}. A collective that some ranks skip, or call "
                    "with different shapes, never completes; call it on every rank with the same shapes")
            if poll.stalled_s < self.hang_ceiling_s:
                # Everyone answers and nobody is behind (a long evaluation, a slow filesystem):
                # nothing points at a culprit, so only the ceiling ends the wait.
                return None
        causes = {w: f"was behind its peers at {suspects[w]}, past the hang deadline" for w in hung}
        return Hung(causes, poll.stalled_s, poll.deadline_s)


@dataclass(frozen=True)
class StragglerCheck:
    """A member whose own compute exceeded `factor` times the others' median in each of the last
    `steps` steps (`policies.find_straggler`), or else one on a node whose every link is that much
    slower than the others' (`policies.find_slow_link`): step timings cannot name a slow link,
    since in a ring all-reduce every rank waits on it alike."""

    factor: float
    steps: int

    def read(self, compute: dict[int, dict[int, float]],
             link_rates: dict[int, tuple[str, dict[str, float]]]) -> Straggling | None:
        """`compute`: member -> {step: its own compute seconds}; `link_rates`: member -> (its
        address, {peer address: bytes per busy second}) over the last `steps` steps."""
        found = (policies.find_straggler(compute, self.factor, self.steps)
                 or policies.find_slow_link(link_rates, compute, self.factor))
        return Straggling(*found) if found else None
