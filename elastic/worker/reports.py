"""Which of a worker's step and metrics reports go to the controller, and when.

Every rank of a generation commits the same steps with the same global batch, so replica 0's
reports already carry the run's per-step figures (step count, step time, throughput, goodput,
the latest metrics, which are the lowest reporting rank's) and the time of its last committed
step, which the hang and reach deadlines are measured from. Replica 0 is rank 0 in a plain
data-parallel run, ranks 0 to S-1 with replicas of S workers (a pipeline's loss is reported by
its last stage). One call per worker every 0.2 s instead cost the controller a core at a few
hundred workers. So (`ReportQueue.take`):

- the ranks of replica 0 send what they hold every REPORT_INTERVAL_S, as every rank did before;
- another rank keeps its last HOLD_S of reports and sends nothing. When it joins replica 0 (a
  rank of it died), it sends those first: they cover the steps the dead rank committed but never
  sent, and the controller counts each step once;
- with the straggler check on (`every_rank`), which compares each rank's own compute time,
  every other rank sends all it holds every `interval_s(W)` = max(REPORT_INTERVAL_S,
  W / REPORT_CALLS_PER_S) seconds, at a phase set by its rank, so that their calls reach the
  controller evenly spread, at most REPORT_CALLS_PER_S a second at any world size W.

So the controller gets 5 calls a second per worker of a replica whatever W, plus
REPORT_CALLS_PER_S with the straggler check (docs/architecture.md, "Scale, on paper").

`ReportSender` makes those calls, and makes the run's last one wait for them all.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable
from typing import Any

import ray
import torch

REPORT_INTERVAL_S = 0.2
# The other ranks' calls a second, all together, when the straggler check needs each rank's compute.
REPORT_CALLS_PER_S = 100
# How far back from its newest report a rank outside replica 0 keeps its reports: far more than
# replica 0's interval, so that it holds whatever a rank it replaces committed and had not sent.
HOLD_S = 5.0


def interval_s(world_size: int) -> float:
    """How often each rank outside replica 0 sends its reports when every rank must: its share
    of REPORT_CALLS_PER_S, never more often than replica 0."""
    return max(REPORT_INTERVAL_S, world_size / REPORT_CALLS_PER_S)


class ReportQueue:
    """A worker's reports, from the train thread (`add`) to the controller (`take`)."""

    def __init__(self, every_rank: bool, replica_size: int = 1) -> None:
        self.every_rank = every_rank
        self.replica_size = replica_size
        self._new: collections.deque = collections.deque()  # appended by the train thread
        self._held: collections.deque = collections.deque()
        self._next_at: float | None = None  # when this rank sends next (every_rank)
        self._lock = threading.Lock()  # the report thread and the run's final flush both take

    def add(self, item: dict[str, Any]) -> None:
        self._new.append(item)

    def take(self, rank: int, world_size: int, now: float, final: bool = False) -> list[dict[str, Any]]:
        """The reports to send now, by the rule above, at this worker's current `rank` in a
        generation of `world_size`; `final` when its train loop ended (every rank that sends at
        all sends everything it holds)."""
        with self._lock:
            while self._new:
                self._held.append(self._new.popleft())
            if 0 <= rank < self.replica_size or (self.every_rank and (final or self._due(rank, world_size, now))):
                items = list(self._held)
                self._held.clear()
                return items
            if not self.every_rank:
                # Counted back from its newest report, not from now: a heal can take longer.
                while self._held and self._held[0]["time"] < self._held[-1]["time"] - HOLD_S:
                    self._held.popleft()
            return []

    def _due(self, rank: int, world_size: int, now: float) -> bool:
        """At this rank's turns (`next_turn`). Its first is scheduled once it is in a generation,
        and a change of W takes effect after the turn already scheduled, so neither a start nor a
        heal sends a burst."""
        if rank < 0:
            return False  # in no generation: it has no steps to report
        due = self._next_at is not None and now >= self._next_at
        if self._next_at is None or due:
            self._next_at = next_turn(rank, world_size, now)
        return due


def next_turn(rank: int, world_size: int, now: float) -> float:
    """When rank `rank` of `world_size` next sends, after `now`, when every rank reports: once
    per `interval_s`, at the (rank / W)th part of it, so that the ranks' calls are spread evenly."""
    every = interval_s(world_size)
    turn = every * rank / world_size
    at = turn + every * (math.floor((now - turn) / every) + 1)
    return at if at > now else at + every  # (now - turn) / every rounded down below a whole number


def plain_metrics(item: dict[str, Any]) -> dict[str, Any]:
    """A report with the user's tensor metrics (a loss reported without `.item()`) made numbers: here,
    on the report thread, so the train thread never waits for the device for them. As tensors the
    journal wrote them as strings ('tensor(7.23)'), and a CUDA one could not be unpickled by the
    controller, which has no GPU."""
    if item["kind"] != "metrics":
        return item
    return {**item, "metrics": _plain(item["metrics"])}


def _plain(value: Any) -> Any:
    """`value` with its plain dense tensors made numbers (or lists), inside dicts, lists and tuples
    too; another tensor kind (sparse, a DTensor, whose value may need a collective) is left as it is."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if type(value) is torch.Tensor and value.layout == torch.strided:
        return value.item() if value.numel() == 1 else value.tolist()
    return value


class ReportSender:
    """Sends what a worker's `ReportQueue` gives, from the report thread and as the run ends, and
    keeps the worker's other one-way calls (`track`: ready, broken, formed).

    `send` is a one-way call to the controller, which returns its ObjectRef. The controller is an
    async actor, which may run a worker's calls out of order, and it learns the run's outcome from
    the return of the worker's `run`, which no call precedes. So the last flush returns only once
    the controller ran every call this worker made: the report thread's too, or `Result.step`
    could miss the last steps (seen once in CI: 60 of 64), and a generation's `formed`, or the
    controller would take a member's end for a formation that never completed.
    """

    def __init__(self, queue: ReportQueue, send: Callable[[list[dict[str, Any]]], Any]) -> None:
        self._queue = queue
        self._send = send
        self._in_flight: list[Any] = []  # calls the controller may not have run yet
        self._lock = threading.Lock()  # the report thread and the run's last flush both send

    def track(self, call: Any) -> None:
        """A one-way call made to the controller (its ObjectRef), which the last flush waits for."""
        with self._lock:
            self._in_flight.append(call)

    def flush(self, rank: int, world_size: int, now: float, final: bool = False,
              extra: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        """Send the reports due (`ReportQueue.take`), with `extra()`'s item if it gives one; `final`
        sends all and waits for every call sent."""
        with self._lock:
            items = self._queue.take(rank, world_size, now, final)
            if items:
                more = extra()
                if more:
                    items.append(more)
                self._in_flight.append(self._send([plain_metrics(item) for item in items]))
            if final:
                ray.get(self._in_flight)
                self._in_flight = []
            elif self._in_flight:
                _, self._in_flight = ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
