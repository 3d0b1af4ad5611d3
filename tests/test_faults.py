"""Injected hangs, stragglers and application errors on a local Ray.

A hung rank must be found by the step-time deadline and killed, and the survivors healed;
a straggler evicted when the policy is on; an application error raised, not healed.
"""

import pytest

from elastic import DataConfig, ElasticTrainer, FailureConfig, Fault, RunConfig, ScalingConfig, TrainingFailedError
from workloads import GLOBAL_BATCH, STEPS_PER_EPOCH, fit_held, regression_loop, workers_started

MAX_STEPS = 10 * STEPS_PER_EPOCH

pytestmark = pytest.mark.timeout(180)


def _fit(tmp_path, name, faults, failure=FailureConfig(), sleep_s=0.0):
    # Held after step 0 until both workers started: a start that formed without a slow one
    # takes it in by step 3, so the fault on rank 1 finds it.
    return fit_held(ElasticTrainer(
        regression_loop,
        train_loop_config={"max_steps": MAX_STEPS, "sleep_s": sleep_s, "gate": (0, str(tmp_path / f"{name}-started"))},
        scaling_config=ScalingConfig(min_workers=1, max_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), failure_config=failure),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=16, max_steps=MAX_STEPS),
        faults=faults,
        show_progress=False,
    ), workers_started(2))


def _exactly_once(result):
    ledger = result.value["ledger"]
    return bool((ledger == 1).all())


def test_a_rank_hung_in_the_all_reduce_is_found_by_the_deadline_killed_and_healed_around(local_ray, tmp_path):
    failure = FailureConfig(hang_floor_s=1.0, hang_factor=10)
    result = _fit(tmp_path, "hang", [Fault(kind="hang", rank=1, step=12)], failure)
    [hung] = result.events_of("worker_failed")
    assert hung["kind"] == "hang" and hung["rank"] == 1
    assert hung["detect_s"] > hung["deadline_s"] >= 1.0  # the deadline came from the floor, not 30 minutes
    heal = next(e for e in result.events_of("generation_formed") if e["time"] > hung["time"])
    assert (heal["kind"], heal["world_size"]) == ("heal", 1), "the survivor did not heal around the hung rank"
    assert result.step == MAX_STEPS and _exactly_once(result)


def test_a_straggler_is_evicted_when_the_policy_is_on_and_the_run_shrinks(local_ray, tmp_path):
    failure = FailureConfig(straggler_factor=3, straggler_steps=5)
    result = _fit(tmp_path, "straggler", [Fault(kind="slow", rank=1, step=10, factor=8)], failure, sleep_s=0.01)
    [evicted] = result.events_of("worker_failed")
    assert evicted["kind"] == "straggler" and evicted["rank"] == 1
    assert any(e["action"] == "EVICT" and "straggler_factor=3" in e["reason"] for e in result.events_of("decision"))
    assert result.step == MAX_STEPS and _exactly_once(result)


def test_an_injected_application_error_fails_the_run_instead_of_healing(local_ray, tmp_path):
    with pytest.raises(TrainingFailedError, match="injected application error on rank 0 at step 7"):
        _fit(tmp_path, "raise", [Fault(kind="raise", rank=0, step=7)])
