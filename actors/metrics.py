"""The run's metrics in Ray's metrics system: its Prometheus endpoint and dashboard.

The controller updates these on every tick; Ray's metrics agent exports them, tagged with
the run name, as `ray_elastic_*` on each node's `metrics_export_port`.
"""

from __future__ import annotations

import statistics
from typing import Any

from ray.util.metrics import Counter, Gauge

TAG = ("run",)


class RunMetrics:
    def __init__(self, run: str) -> None:
        self._tags = {"run": run}
        self.step_time = Gauge("elastic_step_time_s", "Median time of the recent committed steps.", TAG)
        self.world_size = Gauge("elastic_world_size", "Workers in the current generation.", TAG)
        self.samples_per_s = Gauge("elastic_samples_per_s", "Samples consumed per second, recently.", TAG)
        self.step = Gauge("elastic_step", "Committed optimizer steps.", TAG)
        self.goodput = Gauge("elastic_goodput", "Committed step time over wall time so far.", TAG)
        self.checkpoint_stall = Gauge("elastic_checkpoint_stall_s", "Time the last checkpoint blocked training.", TAG)
        self.recoveries = Counter("elastic_recoveries", "Heals and restarts after failures.", TAG)
        for metric in (self.step_time, self.world_size, self.samples_per_s, self.step, self.goodput,
                       self.checkpoint_stall, self.recoveries):
            metric.set_default_tags(self._tags)

    def update(self, step_times: Any, world_size: int, samples_per_s: float, step: int, goodput: float) -> None:
        if step_times:
            self.step_time.set(statistics.median(step_times))
        self.world_size.set(world_size)
        self.samples_per_s.set(samples_per_s)
        self.step.set(step)
        self.goodput.set(goodput)

    def checkpoint_saved(self, stall_s: float) -> None:
        self.checkpoint_stall.set(stall_s)

    def recovered(self) -> None:
        self.recoveries.inc()
