"""Injected hangs, stragglers and application errors on a local Ray.

A hung rank must be found by the step-time deadline and killed, and the survivors healed;
a straggler evicted when the policy is on; an application error raised, not healed.
"""

import time

import pytest
import ray

from elastic import DataConfig, ElasticTrainer, FailureConfig, Fault, RunConfig, ScalingConfig, TrainingFailedError
from workloads import GLOBAL_BATCH, STEPS_PER_EPOCH, fit_held, regression_loop, workers_started

MAX_STEPS = 10 * STEPS_PER_EPOCH

pytestmark = pytest.mark.timeout(180)


def _fit(tmp_path, name, faults, failure=FailureConfig(), compute_s=0.0, hold=None):
    """`compute_s`: each step's compute, slept inside the step; `hold`: (step, condition): the
    loop is held again after `step` until `condition(events)`."""
    # Held after step 0 until both workers started: a start that formed without a slow one
    # takes it in by step 3, so the fault on rank 1 finds it.
    gates = [(hold[0], str(tmp_path / f"{name}-held"))] if hold else []
    return fit_held(ElasticTrainer(
        regression_loop,
        train_loop_config={"max_steps": MAX_STEPS, "compute_s": compute_s, "gate": (0, str(tmp_path / f"{name}-started")),
                           "gates": gates},
        scaling_config=ScalingConfig(min_workers=1, max_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), failure_config=failure),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=16, max_steps=MAX_STEPS),
        faults=faults,
        show_progress=False,
    ), workers_started(2), *([hold[1]] if hold else []))


def _exactly_once(result):
    ledger = result.value["ledger"]
    return bool((ledger == 1).all())


class LateReports:
    """A gate's condition: once the survivor healed around the worker the controller gave up on,
    send what that worker's report thread and checkpoint writer would send late (a cut-off
    worker runs on), in its name; holds until the controller journaled the refusal."""

    LATE_STEP = 10**6

    def __init__(self, name):
        self.name, self.step_after = name, None

    def __call__(self, events):
        failed = [e for e in events if e["type"] == "worker_failed"]
        if not failed or not [e for e in events if e["type"] == "generation_formed" and e["time"] > failed[0]["time"]]:
            return False
        if self.step_after is None:
            controller, worker = ray.get_actor(f"elastic-controller-{self.name}"), failed[0]["worker_id"]
            step = {"kind": "step", "step": self.LATE_STEP, "rank": 1, "world_size": 2, "generation": 0, "step_s": 0.01,
                    "compute_s": 0.01, "samples": GLOBAL_BATCH, "time": time.time()}
            ray.get([controller.ingest.remote(worker, [step]),
                     controller.shard_written.remote(worker, {"rank": 1, "step": 16, "generation": 0, "error": "late"})])
            self.step_after = ray.get(controller.status.remote())["step"]
        return any(e["type"] == "fenced" for e in events)


@pytest.fixture(scope="module")
def hung_run(local_ray, tmp_path_factory):
    """One run for the hang and for what the worker given up on sends later: rank 1 hangs in the
    all-reduce of step 12, and the loop is held after step 20, past the heal, until the late
    reports were sent in its name and refused (`LateReports`)."""
    failure = FailureConfig(hang_floor_s=1.0, hang_factor=10)
    late = LateReports("late")
    result = _fit(tmp_path_factory.mktemp("late"), "late", [Fault(kind="hang", rank=1, step=12)], failure,
                  hold=(20, late))
    return late, result


def test_a_rank_hung_in_the_all_reduce_is_found_by_the_deadline_killed_and_healed_around(hung_run):
    _, result = hung_run
    [hung] = result.events_of("worker_failed")
    assert hung["kind"] == "hang" and hung["rank"] == 1
    assert hung["detect_s"] > hung["deadline_s"] >= 1.0  # the deadline came from the floor, not 30 minutes
    heal = next(e for e in result.events_of("generation_formed") if e["time"] > hung["time"])
    assert (heal["kind"], heal["world_size"]) == ("heal", 1), "the survivor did not heal around the hung rank"
    assert result.step == MAX_STEPS and _exactly_once(result)


def test_what_a_worker_given_up_on_sends_later_is_refused_and_journaled(hung_run):
    late, result = hung_run
    [hung] = result.events_of("worker_failed")
    assert late.step_after < LateReports.LATE_STEP, "a late report of a worker given up on counted"
    fenced = result.events_of("fenced")
    assert sorted(e["refused"] for e in fenced) == ["checkpoint_shard", "reports"], fenced
    assert all(e["worker_id"] == hung["worker_id"] and "gave up" in e["reason"] for e in fenced), fenced
    assert not result.events_of("checkpoint_skipped"), "a late shard report of a worker given up on was taken"
    assert result.step == MAX_STEPS and _exactly_once(result)


def test_a_straggler_is_evicted_when_the_policy_is_on_and_the_run_shrinks(local_ray, tmp_path):
    failure = FailureConfig(straggler_factor=3, straggler_steps=5)
    # The slow rank's steps take 8 times its compute. A compute of 10 ms, slept inside the step,
    # keeps the ratio above 3 on a loaded machine: the MLP's own 2 ms, with the sleep outside the
    # step, let rank 0's noise bring one of any 5 steps under 3 (a CI run at -n 2 evicted no one).
    result = _fit(tmp_path, "straggler", [Fault(kind="slow", rank=1, step=10, factor=8)], failure, compute_s=0.01)
    [evicted] = result.events_of("worker_failed")
    assert evicted["kind"] == "straggler" and evicted["rank"] == 1
    assert any(e["action"] == "EVICT" and "straggler_factor=3" in e["reason"] for e in result.events_of("decision"))
    assert result.step == MAX_STEPS and _exactly_once(result)


def test_an_injected_application_error_fails_the_run_instead_of_healing(local_ray, tmp_path):
    with pytest.raises(TrainingFailedError, match="injected application error on rank 0 at step 7"):
        _fit(tmp_path, "raise", [Fault(kind="raise", rank=0, step=7)])
