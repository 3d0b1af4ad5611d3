"""Pure decisions of the controller: what to do about a failure, and which membership to run.

The controller observes, asks these functions, logs the decision with its reason, and acts.
Nothing here touches Ray, so each rule is tested directly.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal, Sequence

# Step times measured before the stall deadline follows them instead of the ceiling.
MIN_STEP_SAMPLES = 5
# A step that takes this many median steps without committing is worth a ping of every member.
REACH_FACTOR = 1.2  # a step 20% over the median costs a poll, no verdict
# A generation's connect may take this many times the last one's before it is given up, and
# never more than the ceiling (the connect timeout of a worker's spec, `elastic.comm.group`).
CONNECT_FACTOR = 4
CONNECT_CEILING_S = 3.0


@dataclass(frozen=True)
class FailureDecision:
    action: Literal["HEAL", "RESTART", "RAISE"]
    reason: str


def decide_failure(
    kind: Literal["death", "all_lost", "app_error"], failures: int, max_failures: int
) -> FailureDecision:
    """A dead worker is healed around by the survivors, at no cost. Losing every worker (a
    restart from the latest durable checkpoint) and an application error are failures, each
    tolerated only `max_failures` times in all.

    `failures` counts those failures so far, including this one.
    """
    if kind == "death":
        return FailureDecision("HEAL", "a worker died; the survivors heal in place (deaths do not count as failures)")
    if failures <= max_failures:
        action = "RESTART" if kind == "all_lost" else "HEAL"
        return FailureDecision(
            action,
            f"Deciding to {action}, since the total failure count ({failures}) <= FailureConfig(max_failures={max_failures})",
        )
    return FailureDecision(
        "RAISE",
        f"Deciding to RAISE, since the total failure count ({failures}) > FailureConfig(max_failures={max_failures})",
    )


@dataclass(frozen=True)
class NoopDecision:
    reason: str = "membership is as wanted"


@dataclass(frozen=True)
class ResizeDecision:
    members: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class WaitDecision:
    reason: str


def decide_membership(
    members: Sequence[int],
    ready: Sequence[int],
    generation_broken: bool,
    min_workers: int,
    max_workers: int,
    unit: int = 1,
) -> NoopDecision | ResizeDecision | WaitDecision:
    """The next membership, from the live members of the current generation and ready newcomers.

    Members keep their order (so ranks change as little as possible); newcomers are appended
    up to `max_workers`. Below `min_workers` the answer is to wait for capacity. With replicas
    of `unit` workers, `ready` lists whole replicas, member by member, and only whole ones join.
    """
    room = max(0, max_workers - len(members)) // unit * unit
    joining = tuple(ready[:room])
    wanted = tuple(members) + joining
    if len(wanted) < min_workers:
        return WaitDecision(
            f"only {len(wanted)} workers can run, fewer than min_workers({min_workers}); waiting for capacity"
        )
    if not members:
        return ResizeDecision(wanted, f"start: {len(joining)} ready workers")
    if generation_broken:
        return ResizeDecision(wanted, f"heal: {len(members)} live members and {len(joining)} ready newcomers")
    if joining:
        return ResizeDecision(wanted, f"grow: {len(joining)} ready newcomers, {len(members)} -> {len(wanted)} workers")
    return NoopDecision()


def workers_to_start(live: int, max_workers: int) -> int:
    """How many worker actors to request so that live + pending reaches `max_workers`."""
    return max(0, max_workers - live)


def hang_deadline(step_times: Sequence[float], factor: float, floor_s: float, ceiling_s: float) -> float:
    """How long the run may go without committing a step: `factor` median steps, within bounds."""
    if len(step_times) < MIN_STEP_SAMPLES:
        return ceiling_s
    return min(ceiling_s, max(floor_s, factor * statistics.median(step_times)))


def reach_deadline(step_times: Sequence[float], floor_s: float, ceiling_s: float) -> float:
    """How long the run may go without committing a step (or since the last ping) before its
    members are pinged: REACH_FACTOR median steps, within [`floor_s`, `ceiling_s`] (`floor_s`
    until steps are measured). A ping costs a call per member, and one that answers is left
    alone until the hang deadline, so this can be short: it is what bounds the time to see a
    member cut off by the network. The ceiling keeps that bound at slow steps: at 3 s steps the
    members are pinged every `ceiling_s` of a step instead of once 3.6 s after its start."""
    if len(step_times) < MIN_STEP_SAMPLES:
        return floor_s
    return min(ceiling_s, max(floor_s, REACH_FACTOR * statistics.median(step_times)))


def connect_deadline(last_connect_s: float | None, failed_in_a_row: int, floor_s: float,
                     ceiling_s: float = CONNECT_CEILING_S) -> float:
    """How long a generation's members may take to connect its groups: CONNECT_FACTOR times the
    slowest connect of the last generation that formed, never less than `floor_s`, doubled for
    each generation in a row that failed to form, and never more than `ceiling_s` (nor less than
    the ceiling before any generation formed: fresh processes connect their first group).

    A member that dies after the barrier leaves its peers waiting in gloo's connect until this
    expires (5 times it where the peer published its address and never connected: gloo's own
    retries), so it bounds what a death inside a heal's connect costs; an expiry on a slow
    machine costs one more offer, with twice the time."""
    if last_connect_s is None:
        return ceiling_s
    return min(ceiling_s, max(floor_s, CONNECT_FACTOR * last_connect_s) * 2 ** failed_in_a_row)


def find_hung(progress: dict[int, tuple[int, ...] | None]) -> list[int]:
    """The members to kill when the run stalls, from each one's progress tuple
    (step, gradient syncs entered, all-reduces launched).

    A member that does not answer is hung. Otherwise the members behind the front are: a hung
    rank never enters (or never launches) the sync its peers wait in. When nobody is behind,
    the whole generation is stuck and every member is returned.
    """
    if not progress:
        return []
    silent = [w for w, p in progress.items() if p is None]
    if silent:
        return silent
    front = max(progress.values())
    return [w for w, p in progress.items() if p < front] or list(progress)


def find_straggler(
    compute: dict[int, dict[int, float]], factor: float, steps: int
) -> tuple[int, str] | None:
    """A member whose own compute exceeded `factor` times the others' median in each of the last
    `steps` steps that every member reported, with the reason; None when there is none.

    `compute` maps member -> {step: seconds from step start to its first gradient all-reduce},
    which excludes the time spent waiting for slower peers.
    """
    if len(compute) < 2:
        return None
    common = sorted(set.intersection(*(set(c) for c in compute.values())))[-steps:]
    if len(common) < steps:
        return None
    for member, times in compute.items():
        ratios = []
        for step in common:
            others = statistics.median(c[step] for w, c in compute.items() if w != member)
            ratios.append(times[step] / others if others > 0 else 0.0)
        if min(ratios) > factor:
            return member, (
                f"its compute took {min(ratios):.1f}x to {max(ratios):.1f}x the others' median in each of the last "
                f"{steps} steps, above FailureConfig(straggler_factor={factor})"
            )
    return None


def find_slow_link(
    rates: dict[int, tuple[str, dict[str, float]]], compute: dict[int, dict[int, float]], factor: float
) -> tuple[int, str] | None:
    """A member on a node whose every connection, to and from it, sent at less than 1/`factor` of
    the median rate of the connections between other nodes, with the reason; None when none is.

    `rates` maps member -> (its node's address, {peer address: bytes per busy second});
    `compute` is `find_straggler`'s, which the reason quotes: a node slow on the network
    computes like the others. It takes three nodes with data between them: with two, each one's
    only link is the other's, and nothing tells which end is slow.
    """
    links: dict[tuple[str, str], float] = {}
    for address, peers in rates.values():
        for peer, rate in peers.items():
            if peer != address:
                links[address, peer] = min(rate, links.get((address, peer), rate))
    for node in sorted({end for link in links for end in link}):
        own = [rate for link, rate in links.items() if node in link]
        others = [rate for link, rate in links.items() if node not in link]
        if not others or max(own) * factor >= statistics.median(others):
            continue
        member = min(w for w, (address, _) in rates.items() if address == node)
        return member, (
            f"the network: every connection to and from its node {node} carried at most {_rate(max(own))}, "
            f"where the others' median was {_rate(statistics.median(others))}, more than FailureConfig("
            f"straggler_factor={factor}) times as fast; its own compute took {_compute_ratio(compute, member)} "
            "the others' median"
        )
    return None


# Past this many addresses on the cut links, the cover is found greedily instead of exactly.
EXACT_COVER_ADDRESSES = 12


def find_cut_off(addresses: dict[int, str], silent: dict[int, dict[str, float]], silence_s: float) -> list[int]:
    """The members to heal around in a partial partition: the smallest set that explains every
    cut link, never a member merely waiting on one.

    `addresses` is each member's address (as its peers' connections see it, by worker id, in
    rank order); `silent` what each member's connections say: per peer address, how long data
    sent there has gone unacknowledged while the kernel retransmits it. A link silent for
    `silence_s` or longer is cut. A cut cuts addresses, not processes, so the cover is a set of
    addresses, each weighing its members; among covers of the same weight, the one of fewer
    addresses (one faulty node explains more simply than two), then the one that keeps the lowest
    ranks. Rank 1 cut from ranks 0 and 2 is covered by rank 1 alone; two ranks cut from each other
    by the higher one.
    """
    rank_of = {worker: rank for rank, worker in enumerate(addresses)}
    members_at: dict[str, list[int]] = {}
    for worker, address in addresses.items():
        members_at.setdefault(address, []).append(worker)
    edges = {frozenset((addresses[worker], peer))
             for worker, peers in silent.items() if worker in addresses
             for peer, seconds in peers.items()
             if seconds >= silence_s and peer in members_at and peer != addresses[worker]}
    if not edges:
        return []
    involved = sorted({address for edge in edges for address in edge})

    def cost(cover: tuple[str, ...]) -> tuple[int, int, list[int]]:
        ranks = sorted((rank_of[w] for a in cover for w in members_at[a]), reverse=True)
        return sum(len(members_at[a]) for a in cover), len(cover), [-r for r in ranks]

    if len(involved) <= EXACT_COVER_ADDRESSES:
        covers = (tuple(a for i, a in enumerate(involved) if mask >> i & 1) for mask in range(1, 1 << len(involved)))
        best = min((c for c in covers if all(edge & set(c) for edge in edges)), key=cost)
    else:
        best, left = (), set(edges)
        while left:
            address = max(involved, key=lambda a: (sum(a in e for e in left), -len(members_at[a]),
                                                   max(rank_of[w] for w in members_at[a])))
            best += (address,)
            left = {edge for edge in left if address not in edge}
    return sorted((w for a in best for w in members_at[a]), key=rank_of.__getitem__)


def _rate(bytes_per_s: float) -> str:
    return "a burst too short to time" if bytes_per_s == float("inf") else f"{bytes_per_s * 8 / 1e6:.0f} Mbit/s"


def _compute_ratio(compute: dict[int, dict[int, float]], member: int) -> str:
    own = list(compute.get(member, {}).values())
    others = [t for w, times in compute.items() if w != member for t in times.values()]
    if not own or not others or statistics.median(others) <= 0:
        return "an unmeasured share of"
    return f"{statistics.median(own) / statistics.median(others):.1f}x"


def nodes_to_avoid(
    failures: dict[str, list[float]], now: float, limit: int, cooldown_s: float, alive: set[str]
) -> set[str]:
    """Live nodes where workers failed at least `limit` times in the last `cooldown_s` seconds.

    New workers are kept off them until the failures age out, so a rank that crash-loops
    because of its machine is not restarted there forever. A node is never avoided when it
    would leave no live node at all: a crash loop there beats no workers anywhere.
    """
    flaky = {node for node, times in failures.items() if sum(now - t <= cooldown_s for t in times) >= limit}
    avoid = flaky & alive
    return set() if avoid >= alive else avoid
