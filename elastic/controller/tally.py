"""The controller's tally of a run: its committed steps, throughput, productive time and metrics.

Replica 0's ranks (rank 0 in a plain data-parallel run) report each committed step (its duration
and world size) and the user's metrics in batches (the other ranks only with the straggler check:
`elastic.worker.reports`);
`RunTally` folds them into the step count, throughput, productive time (for
goodput) and the latest metrics. The driver shows them with `elastic.journal.display`. For the straggler
check it keeps each worker's own compute per step and what its connections sent to each peer
(`elastic.comm.links.GroupLinks.traffic`), as link rates over the last steps. (Where the train
thread of each member is, for the hang check, is its probe's reading: `signals.ProbeReading`.)
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

THROUGHPUT_WINDOW_S = 5.0
# Goodput's productive time: a step that took longer than this many median steps stood still
# (judged once this many steps were measured), and counts as one median step.
STALL_FACTOR = 3.0
STALL_SAMPLES = 5
METRICS_EVENT_INTERVAL_S = 2.0
COMPUTE_HISTORY = 200
# A connection that sent less than this in the judged steps carried control messages, not a
# collective's data: its rate says nothing about the link.
LINK_MIN_BYTES = 256 * 1024


class RunTally:
    def __init__(self, max_steps: int | None) -> None:
        self.max_steps = max_steps  # None: the run ends where the train loops return
        self.step = 0
        self.noted_step = 0
        # The newest step report's step: unlike `step`, it goes back when a restart replays
        # from a checkpoint, so the replayed steps count as the run making progress.
        self.reported_step = 0
        self.productive_s = 0.0
        self.last_metrics: dict[str, Any] = {}
        self._metrics_key = (-1, 0)
        self._recent: collections.deque = collections.deque()
        self.last_step_time = 0.0
        self.step_times: collections.deque = collections.deque(maxlen=COMPUTE_HISTORY)
        # worker -> {step: seconds of its own compute before its first gradient all-reduce}
        self.compute: dict[int, dict[int, float]] = {}
        # worker -> its link samples, one per step: (generation, step, address, {peer: (bytes, busy_s)})
        self.links: dict[int, collections.deque] = {}
        self._last_sample = 0.0

    def _productive(self, step_s: float) -> float:
        """What of a committed step's time was training: all of it, up to STALL_FACTOR median steps.
        A step that stood still longer (a collective waiting on a cut link until a heal or the
        link's return ended it) counts one median step; the rest of its time is lost."""
        if len(self.step_times) < STALL_SAMPLES:
            return step_s
        median = statistics.median(self.step_times)
        return step_s if step_s <= STALL_FACTOR * median else median

    def ingest(self, worker_id: int, items: list[dict[str, Any]]) -> None:
        for item in items:
            if item["kind"] == "step":
                self.last_step_time = max(self.last_step_time, item["time"])
                if item.get("compute_s") is not None:
                    recent = self.compute.setdefault(worker_id, {})
                    recent[item["step"]] = item["compute_s"]
                    for old in sorted(recent)[:-COMPUTE_HISTORY]:
                        del recent[old]
                self.reported_step = item["step"] + 1
                # Replica 0's ranks report the same committed step, a rank joining replica 0 sends
                # again the steps it held, and with the straggler check every rank reports them:
                # count each once, from the first report.
                if item["step"] + 1 > self.step:
                    self.step = item["step"] + 1
                    self.productive_s += self._productive(item["step_s"])
                    self.step_times.append(item["step_s"])
                    self._recent.append((item["time"], item["samples"], item["world_size"]))
            elif item["kind"] == "links":
                samples = self.links.setdefault(worker_id, collections.deque(maxlen=COMPUTE_HISTORY))
                sample = (item["generation"], item["step"], item["address"], item["sent"])
                if samples and samples[-1][:2] == sample[:2]:
                    samples[-1] = sample  # the newest totals of a step replace the older
                else:
                    samples.append(sample)
            elif item["kind"] == "metrics":
                # Newest step wins; within a step, the lowest rank's metrics.
                key = (item["step"], -item["rank"])
                if key >= self._metrics_key:
                    self._metrics_key = key
                    self.last_metrics = {"step": item["step"], **item["metrics"]}
        horizon = time.time() - THROUGHPUT_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

    def link_rates(self, members: list[int], steps: int) -> dict[int, tuple[str, dict[str, float]]]:
        """Per member with `steps` steps of samples in its current generation: its address and the
        rate (bytes per busy second) its connections sent each peer at over those steps."""
        rates = {}
        for worker_id in members:
            samples = self.links.get(worker_id)
            if not samples:
                continue
            generation, step, address, newest = samples[-1]
            older = [s for s in samples if s[0] == generation and s[1] <= step - steps]
            if not older:
                continue
            oldest = older[-1][3]
            peers = {}
            for peer, (sent, busy_s) in newest.items():
                then_sent, then_busy_s = oldest.get(peer, (0, 0.0))
                if sent - then_sent >= LINK_MIN_BYTES:
                    busy = busy_s - then_busy_s
                    # The kernel counts busy time in clock ticks: a fast link's burst can read 0.
                    peers[peer] = (sent - then_sent) / busy if busy > 0 else float("inf")
            rates[worker_id] = (address, peers)
        return rates

    def forget_stragglers(self) -> None:
        """Judge the next generation on its own steps."""
        for times in self.compute.values():
            times.clear()
        self.links.clear()

    def resumed_at(self, step: int) -> None:
        """The run resumed from a checkpoint of `step`: the steps before it are committed, even in
        a run that resumed at its end and reports none."""
        self.step = self.reported_step = step

    def note_step(self, step: int) -> None:
        """A step known to be committed from another source than a step report (which may
        arrive later, and must still be counted)."""
        self.noted_step = max(self.noted_step, step)

    @property
    def latest_step(self) -> int:
        return max(self.step, self.noted_step)

    def samples_per_s(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n, _ in list(self._recent)[1:]) / span if span > 0 else 0.0

    def snapshot(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "max_steps": self.max_steps,
            "samples_per_s": self.samples_per_s(),
            "productive_s": self.productive_s,
            "metrics": self.last_metrics,
        }

    def sample(self) -> dict[str, Any] | None:
        """A metrics event's fields, at most every METRICS_EVENT_INTERVAL_S."""
        now = time.time()
        # Throughput needs two steps in its window; until then there is nothing honest to say.
        if now - self._last_sample < METRICS_EVENT_INTERVAL_S or len(self._recent) < 2:
            return None
        self._last_sample = now
        return {"step": self.step, "samples_per_s": self.samples_per_s(), "metrics": self.last_metrics}
