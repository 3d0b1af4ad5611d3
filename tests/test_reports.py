"""Which reports reach the controller (`elastic.worker.reports`): its calls do not grow with the
world size, and the per-step figures it journals (steps, step time, metrics) and the last step's
time that the hang deadline counts from are the same as when every rank reported. No clocks:
simulated ranks, each with its `ReportQueue`, at fake times; Ray only where the calls are sent
(`ReportSender`), to an async actor as the controller is."""

import asyncio
import collections
import math

import pytest
import ray
import torch

from elastic.controller.tally import RunTally
from elastic.worker.reports import (HOLD_S, REPORT_CALLS_PER_S, REPORT_INTERVAL_S, ReportQueue, ReportSender,
                                    interval_s)

pytestmark = pytest.mark.timeout(60)

STEP_S = 0.1
GLOBAL_BATCH = 64


def step_item(step: int, rank: int, world_size: int, at: float) -> dict:
    return {"kind": "step", "step": step, "rank": rank, "world_size": world_size, "generation": 1,
            "step_s": STEP_S + step * 1e-4, "compute_s": 0.05, "samples": GLOBAL_BATCH, "time": at}


def metrics_item(step: int, rank: int, at: float) -> dict:
    return {"kind": "metrics", "step": step, "rank": rank, "time": at, "metrics": {"loss": 1.0 / (step + 1) + rank}}


class Run:
    """W simulated ranks that commit a step every STEP_S and report it with the user's metrics
    (in replicas of S > 1 workers, a pipeline's, only its last stage reports them); every
    REPORT_INTERVAL_S each rank's report thread takes what is due. `calls` records each call to
    the controller as (time, worker, items)."""

    def __init__(self, world_size: int, every_rank: bool = False, replica_size: int = 1) -> None:
        self.queues = [ReportQueue(every_rank, replica_size) for _ in range(world_size)]
        self.replica_size = replica_size
        self.ranks = list(range(world_size))  # worker -> its rank in the current generation
        self.calls: list[tuple[float, int, list[dict]]] = []
        self.everything: list[dict] = []  # every report any rank made, as if every rank sent each
        self.now = 0.0
        self.step = 0

    def advance(self, seconds: float) -> None:
        ticks = round(seconds / STEP_S)
        for _ in range(ticks):
            self.now = round(self.now + STEP_S, 6)
            world_size = sum(rank >= 0 for rank in self.ranks)
            for worker, queue in enumerate(self.queues):
                rank = self.ranks[worker]
                if rank < 0:
                    continue
                items = [step_item(self.step, rank, world_size, self.now)]
                if rank % self.replica_size == self.replica_size - 1:
                    items.append(metrics_item(self.step, rank, self.now))
                for item in items:
                    queue.add(item)
                    self.everything.append(item)
            self.step += 1
            if math.isclose(self.now / REPORT_INTERVAL_S, round(self.now / REPORT_INTERVAL_S)):
                self.flush(world_size)

    def flush(self, world_size: int) -> None:
        for worker, queue in enumerate(self.queues):
            if self.ranks[worker] >= 0:
                items = queue.take(self.ranks[worker], world_size, self.now)
                if items:
                    self.calls.append((self.now, worker, items))

    def finish(self) -> None:
        """The train loops end: each rank's last take."""
        world_size = sum(rank >= 0 for rank in self.ranks)
        for worker, queue in enumerate(self.queues):
            items = queue.take(self.ranks[worker], world_size, self.now, final=True)
            if items:
                self.calls.append((self.now, worker, items))


def test_the_controller_gets_as_many_report_calls_at_1000_workers_as_at_10():
    small, large = Run(10), Run(1000)
    small.advance(10.0)
    large.advance(10.0)
    assert len(small.calls) == len(large.calls) == 10.0 / REPORT_INTERVAL_S
    assert {worker for _, worker, _ in large.calls} == {0}
    assert sum(len(items) for _, _, items in large.calls) == sum(len(items) for _, _, items in small.calls)


def test_with_the_straggler_check_every_rank_reports_at_an_interval_that_grows_with_the_world_size():
    assert interval_s(10) == REPORT_INTERVAL_S
    assert interval_s(10_000) == 10_000 / REPORT_CALLS_PER_S
    run = Run(500, every_rank=True)
    run.advance(3 * interval_s(500))
    for worker in range(1, 500):
        sent = [items for _, w, items in run.calls if w == worker]
        assert 2 <= len(sent) <= 3  # one call an interval, its first within an interval of its first take
        assert sum(len(items) for items in sent) <= len(run.everything) / 500  # each report once


@pytest.mark.parametrize("world_size", [10, 200, 500])
def test_with_the_straggler_check_the_calls_stay_under_the_cap_and_spread_evenly(world_size):
    run = Run(world_size, every_rank=True)
    run.advance(4 * interval_s(world_size))
    cap_per_tick = (1 / REPORT_INTERVAL_S + REPORT_CALLS_PER_S) * REPORT_INTERVAL_S  # rank 0, and the others
    settled = round(interval_s(world_size) / REPORT_INTERVAL_S)  # past every rank's first turn
    per_tick = collections.Counter(round(at / REPORT_INTERVAL_S) for at, _, _ in run.calls)
    ticks = [count for tick, count in per_tick.items() if tick > settled]
    assert max(ticks) <= math.ceil(cap_per_tick) + 1


def test_a_heal_sends_no_burst_of_calls():
    run = Run(500, every_rank=True)
    run.advance(2 * interval_s(500))
    run.ranks = [-1] + list(range(499))  # worker 0 died; the survivors' ranks move down one
    before = len(run.calls)
    run.advance(REPORT_INTERVAL_S)
    assert len(run.calls) - before <= 1 + math.ceil(REPORT_CALLS_PER_S * REPORT_INTERVAL_S)


def tracker_fed(items: list[dict]) -> RunTally:
    tracker = RunTally(max_steps=10_000)
    tracker.ingest(0, items)
    return tracker


def test_the_journal_s_figures_from_rank_0_alone_are_those_every_rank_s_reports_gave():
    run = Run(8)
    run.advance(5.0)
    run.finish()
    alone = tracker_fed([item for _, _, items in run.calls for item in items])
    everyone = tracker_fed(run.everything)
    assert alone.step == everyone.step == run.step
    assert alone.productive_s == pytest.approx(everyone.productive_s)
    assert list(alone.step_times) == list(everyone.step_times)
    assert alone.last_step_time == everyone.last_step_time == run.now  # what the hang deadline counts from
    assert alone.last_metrics == everyone.last_metrics == {"step": run.step - 1, "loss": 1.0 / run.step}
    assert alone.samples_per_s() == everyone.samples_per_s()


def test_in_a_pipeline_replica_0_reports_and_its_last_stage_s_metrics_reach_the_journal():
    small, large = Run(4, replica_size=2), Run(400, replica_size=2)
    for run in (small, large):
        run.advance(5.0)
        run.finish()
    assert len(small.calls) == len(large.calls) == 2 * 5.0 / REPORT_INTERVAL_S
    assert {worker for _, worker, _ in large.calls} == {0, 1}
    alone = tracker_fed([item for _, _, items in large.calls for item in items])
    assert alone.step == large.step
    assert alone.last_metrics == tracker_fed(large.everything).last_metrics == {
        "step": large.step - 1, "loss": 1.0 / large.step + 1}  # rank 1's: replica 0's last stage


def test_a_new_rank_0_sends_the_steps_the_dead_one_never_sent():
    run = Run(4)
    run.advance(1.0)
    run.advance(STEP_S)  # rank 0 commits a step and dies before its next report
    lost = run.queues[0].take(0, 4, run.now)
    assert [item["step"] for item in lost if item["kind"] == "step"] == [run.step - 1]
    run.ranks = [-1, 0, 1, 2]  # the survivors heal; worker 1 is the new rank 0
    run.advance(1.0)
    run.finish()
    tracker = tracker_fed([item for _, _, items in run.calls for item in items])
    assert tracker.step == run.step
    assert tracker.productive_s == pytest.approx(sum(STEP_S + step * 1e-4 for step in range(run.step)))


def test_a_rank_other_than_0_keeps_only_its_last_seconds_of_reports():
    queue = ReportQueue(every_rank=False)
    for step in range(1000):
        queue.add(step_item(step, 1, 4, step * STEP_S))
        assert queue.take(1, 4, step * STEP_S) == []
    held = queue.take(0, 4, 1000 * STEP_S)
    assert [item["step"] for item in held] == list(range(1000 - round(HOLD_S / STEP_S) - 1, 1000))


@ray.remote
class SlowToIngest:
    """An async actor, as the controller is, busy with the call carrying step 0 for a second:
    the calls after it run meanwhile."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    async def ingest(self, items: list[dict]) -> None:
        if items[0]["step"] == 0:
            await asyncio.sleep(1.0)
        self.steps += [item["step"] for item in items]

    def ingested(self) -> list[int]:
        return self.steps


@pytest.mark.parametrize("first_call", ["the report thread's", "the mailbox's"])
def test_the_runs_last_flush_returns_once_the_controller_ran_every_call_the_worker_made(local_ray, first_call):
    controller = SlowToIngest.remote()
    queue = ReportQueue(every_rank=False)
    sender = ReportSender(queue, controller.ingest.remote)
    if first_call == "the report thread's":
        queue.add(step_item(0, rank=0, world_size=1, at=0.0))
        sender.flush(rank=0, world_size=1, now=0.0)  # its turn: sent, not waited for
    else:  # as a generation's `formed` is sent
        sender.track(controller.ingest.remote([step_item(0, rank=0, world_size=1, at=0.0)]))
    queue.add(step_item(1, rank=0, world_size=1, at=0.1))
    sender.flush(rank=0, world_size=1, now=0.1, final=True)  # the train loop returned
    assert sorted(ray.get(controller.ingested.remote())) == [0, 1]


def test_tensor_metrics_reach_the_controller_as_numbers(local_ray):
    # The journal wrote `elastic.report({"loss": loss})` as the string "tensor(7.2294)", and a CUDA
    # tensor would not unpickle on the controller, which has no GPU.
    sent = []
    queue = ReportQueue(every_rank=False)
    sender = ReportSender(queue, lambda items: sent.append(items) or ray.put(None))
    loss = (torch.ones(2, requires_grad=True) * 3.5).sum()
    queue.add({"kind": "metrics", "step": 0, "rank": 0, "time": 0.0,
               "metrics": {"loss": loss.detach(), "per_class": torch.tensor([1.0, 2.0]), "lr": 0.1,
                           "parts": {"mse": torch.tensor(0.5)}}})
    sender.flush(rank=0, world_size=1, now=0.0, final=True)
    assert sent[0][0]["metrics"] == {"loss": 7.0, "per_class": [1.0, 2.0], "lr": 0.1, "parts": {"mse": 0.5}}
    assert type(sent[0][0]["metrics"]["loss"]) is float
