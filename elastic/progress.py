"""Progress of a run: the controller's tally of committed steps.

Workers report each committed step (its duration and world size) and the user's metrics in
batches; `ProgressTracker` folds them into the step count, throughput, productive time (for
goodput) and the latest metrics. The driver shows them with `elastic.display`.
"""

from __future__ import annotations

import collections
import time
from typing import Any

THROUGHPUT_WINDOW_S = 5.0
METRICS_EVENT_INTERVAL_S = 2.0
COMPUTE_HISTORY = 200


class ProgressTracker:
    def __init__(self, global_batch_size: int, max_steps: int) -> None:
        self.global_batch_size = global_batch_size
        self.max_steps = max_steps
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
        self._last_sample = 0.0

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
                # Every rank reports the same committed step; count it once, from the first report.
                if item["step"] + 1 > self.step:
                    self.step = item["step"] + 1
                    self.productive_s += item["step_s"]
                    self.step_times.append(item["step_s"])
                    self._recent.append((item["time"], item["samples"], item["world_size"]))
            elif item["kind"] == "metrics":
                # Newest step wins; within a step, the lowest rank's metrics.
                key = (item["step"], -item["rank"])
                if key >= self._metrics_key:
                    self._metrics_key = key
                    self.last_metrics = {"step": item["step"], **item["metrics"]}
        horizon = time.time() - THROUGHPUT_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

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
