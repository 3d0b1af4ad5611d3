"""The techniques of `Strategy`, each carried through heals and grows in place.

Equivalences use float64 and Tanh (`regression_loop`), which checks at the first step of
every generation that all ranks hold bit-identical model, optimizer, ledger and technique
state. Mixed precision and compression need float32 (autocast leaves float64 alone).
"""

from types import SimpleNamespace

import pytest
import ray
import torch

from elastic import (CheckpointConfig, DataConfig, ElasticTrainer, FailureConfig, Fault, RunConfig, ScalingConfig,
                     Strategy)
from elastic.checkpoint.checkpoint import checkpoint_steps, checkpoint_storage, verify
from elastic.checkpoint.storage import RunStorage
from elastic.errors import TrainingFailedError
from workloads import (GLOBAL_BATCH, NUM_SAMPLES, OutsideKiller, fit_held, regression_loop, regression_reference,
                       workers_started)

pytestmark = pytest.mark.timeout(240)
MAX_STEPS = 24


def _trainer(tmp_path, name, scaling, strategy=Strategy(), faults=(), max_steps=MAX_STEPS,
             checkpoint=CheckpointConfig(), failure=FailureConfig(), micro_batch_size=32, **loop_config):
    """A run of `regression_loop`."""
    return ElasticTrainer(
        regression_loop,
        train_loop_config={"max_steps": max_steps, **loop_config},
        scaling_config=scaling,
        run_config=RunConfig(name=name, storage_path=str(tmp_path), checkpoint_config=checkpoint,
                             failure_config=failure),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size, max_steps=max_steps),
        strategy=strategy,
        faults=list(faults),
        show_progress=False,
    )


def _fit(tmp_path, name, scaling, *args, **kwargs):
    """A run held after step 0 until its `max_workers` workers started: a start that formed
    without a slow one takes it in by step 3, so a fault on rank 1 finds it however slowly
    workers start."""
    return _fit_held(tmp_path, name, 0, workers_started(scaling.max_workers), scaling, *args, **kwargs)


def _fit_held(tmp_path, name, gate_step, until, *args, from_generation=None, **fit_args):
    """A run held after step `gate_step` (in generation `from_generation` or later, if given)
    until `until(events)` holds (`fit_held`)."""
    gate = (gate_step, str(tmp_path / f"{name}-gate"), *([] if from_generation is None else [from_generation]))
    return fit_held(_trainer(tmp_path, name, *args, gate=gate, **fit_args), until)


# The run `_grow_to_3_once_formed` holds at 2: with the third worker's CPUs taken, the start's
# grace (ScalingConfig.start_grace_s) could only wait, so it forms once 2 are ready.
STARTS_AT_2 = ScalingConfig(min_workers=2, max_workers=3, start_grace_s=0)


def _grow_to_3_once_formed():
    """An `until` for `_fit_held` that makes the run start at 2 workers and grow to 3: another
    actor holds the CPUs a third worker needs until the first generation formed."""

    @ray.remote(num_cpus=2)
    class Hog:
        def ready(self):
            return True

    hog = Hog.remote()
    ray.get(hog.ready.remote())

    def formed_then_freed(events):
        if any(e["type"] == "generation_formed" for e in events):
            ray.kill(hog)
            return workers_started(3)(events)
        return False

    return formed_then_freed


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_exactly_once(ledger, steps):
    consumed = steps * GLOBAL_BATCH
    for epoch in range(ledger.shape[0]):
        in_epoch = min(NUM_SAMPLES, max(0, consumed - epoch * NUM_SAMPLES))
        assert ledger[epoch].sum().item() == in_epoch, f"epoch {epoch}: not every sample counted once"
        assert set(ledger[epoch].unique().tolist()) <= {0.0, 1.0}, f"epoch {epoch}: a sample counted twice"


@pytest.fixture(scope="module")
def ddp_reference():
    """What fault-free DDP computes (one process on each whole global batch, `regression_reference`):
    SGD with momentum, without, in float32, and AdamW."""
    return {
        "momentum": regression_reference(MAX_STEPS, seed=0),
        "plain": regression_reference(MAX_STEPS, seed=0, momentum=0.0),
        "float32": regression_reference(MAX_STEPS, seed=0, dtype="float32"),
        "adamw": regression_reference(MAX_STEPS, seed=0, optimizer="adamw"),
    }


# The local SGD case runs under `-m soak` (the suite's time on 2 cores): in CI local SGD is
# checked through a heal (below), DiLoCo through this grow.
@pytest.mark.parametrize("sync", [pytest.param("local_sgd:every=1", marks=pytest.mark.soak),
                                  "diloco:every=1,outer_lr=1,outer_momentum=0"])
def test_local_sgd_and_diloco_with_one_step_intervals_equal_ddp_through_a_grow(local_ray, tmp_path, ddp_reference,
                                                                                sync):
    # Another actor holds the CPUs a third worker needs, so the run starts at 2; once it
    # formed, that actor goes and the third worker joins in a planned grow, where averaging
    # the inner momentum over the old ranks stays exact.
    result = _fit_held(tmp_path, "h1", 4, _grow_to_3_once_formed(), scaling=STARTS_AT_2,
                       strategy=Strategy(sync=sync))
    assert [(e["kind"], e["world_size"]) for e in result.events_of("generation_formed")] == [("start", 2), ("grow", 3)]
    assert _max_diff(result.value["params"], ddp_reference["momentum"]["params"]) < 1e-9
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)


def test_local_sgd_heals_a_death_by_rolling_back_to_its_last_sync(local_ray, tmp_path, ddp_reference):
    # Without momentum the inner optimizer has no state, so even the heal is exact.
    result = _fit(tmp_path, "h1-kill", ScalingConfig(min_workers=1, max_workers=2), Strategy(sync="local_sgd:every=1"),
                  faults=[Fault(kind="kill", rank=1, step=9)], momentum=0.0)
    assert result.events_of("recovery"), "no heal"
    assert _max_diff(result.value["params"], ddp_reference["plain"]["params"]) < 1e-9
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)


def test_a_spare_that_joins_local_sgd_between_two_checkpoints_of_one_sync_decides_the_second_as_its_peers(
        local_ray, tmp_path):
    # A timed checkpoint is due at every agreement (each 8 steps, taken a step later) and keeps the
    # state of the last sync, every 16: the one at step 25 keeps step 16's, which the one at step
    # 17 wrote, so it is skipped. Rank 1 dies at step 20 and the warm spare joins the heal (at
    # 16, the last sync); the spare never checkpointed, and once took the one at step 25 alone,
    # averaging the inner optimizer's state over the holders: collectives its peer skipped.
    result = _fit_held(tmp_path, "local-sgd-spare", 0, workers_started(3),
                       scaling=ScalingConfig(min_workers=1, max_workers=2, spare_workers=1),
                       strategy=Strategy(sync="local_sgd:every=16"), faults=[Fault(kind="kill", rank=1, step=20)],
                       checkpoint=CheckpointConfig(every_s=0.001), max_steps=40)
    heal = result.events_of("generation_formed")[1]
    assert heal["kind"] == "heal" and heal["world_size"] == 2 and heal["step"] == 16, heal
    _assert_exactly_once(result.value["ledger"], 40)
    assert not result.events_of("warning")
    assert result.checkpoint.step == 40 and result.checkpoint.world_size == 2


# The suite's time on 2 cores: the rollback to the last sync runs in CI through EASGD's (below) and
# local SGD's heals, and DiLoCo's outer step through a grow in the one-step-interval test above.
@pytest.mark.soak
def test_diloco_rolls_a_mid_interval_death_back_and_replays_the_interval_exactly_once(local_ray, tmp_path):
    # Held at step 14 of the healed generation until the replacement started, so it joins in a
    # grow before the end. Not in the first: the survivor may finish step 14 before it learns of
    # the death, and held there it could not join the heal.
    result = _fit_held(tmp_path, "diloco-kill", 14, workers_started(3), from_generation=1,
                       scaling=ScalingConfig(min_workers=1, max_workers=2),
                       strategy=Strategy(sync="diloco:every=8"), faults=[Fault(kind="kill", rank=1, step=13)],
                       max_steps=32)
    [recovery] = result.events_of("recovery")
    assert recovery["steps_lost"] >= 13 - 8, "the interval since the sync at step 8 was not rolled back"
    # regression_loop checked at each generation that every rank holds the same model, inner
    # and outer optimizer state and ledger; the ledger counts each sample exactly once.
    _assert_exactly_once(result.value["ledger"], 32)
    assert result.value["synced_at"][-1] == 32 and all(s % 8 == 0 for s in result.value["synced_at"])
    grows = [e for e in result.events_of("generation_formed") if e["kind"] == "grow"]
    assert grows and all(e["step"] % 8 == 0 for e in grows), f"no grow, or one off a sync boundary: {grows}"


def test_easgd_rolls_a_mid_interval_death_back_restarts_every_rank_from_the_center_and_ends_near_ddp(
        local_ray, tmp_path, ddp_reference):
    # Rank 1 dies at step 14, between the syncs at 12 and 16: the survivor rolls back to 12,
    # replays, and is held at step 14 until the replacement started, which joins in a grow:
    # held in the healed generation, since one held in the first could not join the heal (it
    # may finish step 14 before it learns of the death; a loaded CI machine showed both a heal
    # given up as hung and a heal that waited for the replacement and took it in).
    # At each formation every rank restarts from the center, so regression_loop finds model,
    # center, inner optimizer state and ledger identical on every rank at each generation's
    # first step; after each sync it finds the center identical, and after the last the model.
    result = _fit_held(tmp_path, "easgd-kill", 14, workers_started(3), from_generation=1,
                       scaling=ScalingConfig(min_workers=1, max_workers=2),
                       strategy=Strategy(sync="easgd:every=4,alpha=0.2"), faults=[Fault(kind="kill", rank=1, step=14)],
                       checkpoint=CheckpointConfig(every_steps=8, keep_last=3))
    [recovery] = result.events_of("recovery")
    assert recovery["steps_lost"] >= 14 - 12, "the steps since the sync at step 12 were not rolled back"
    formed = [(e["kind"], e["step"]) for e in result.events_of("generation_formed")]
    assert formed[:2] == [("start", 0), ("heal", 12)], formed
    assert [kind for kind, _ in formed[2:]] == ["grow"] and formed[2][1] % 4 == 0, f"no grow at a sync: {formed}"
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)
    synced_at = result.value["synced_at"]
    assert synced_at[-1] == MAX_STEPS and all(s % 4 == 0 for s in synced_at), synced_at
    assert result.value["outer_syncs"] == MAX_STEPS // 4, "rank 0 synced off the 4-step boundaries"
    # Fault-free at 2 ranks this run ends about 2% above DDP's loss, and through this heal about
    # 3% (from 0.50 at the start to DDP's 0.357): the 10% bound leaves over 3x margin and
    # still fails a center that lags far behind the ranks (a center that never moved ends at 0.50).
    reference = ddp_reference["momentum"]["final_loss"]
    assert abs(result.value["final_loss"] - reference) <= 0.10 * reference
    # Each checkpoint's model is the center, not a mix of the ranks' slices of their own
    # parameters: at step 8 two ranks that differ wrote it.
    run = RunStorage(str(tmp_path), "easgd-kill")
    assert checkpoint_steps(run) == [8, 16, 24]
    for step in checkpoint_steps(run):
        state = verify(checkpoint_storage(run, step)).load_state()
        assert all(torch.equal(model, center) for model, center in zip(state["model"].values(),
                                                                       state["outer_sync"]["anchor"], strict=True)), step


# CI runs bf16 autocast and fp16 gradient compression together through one heal; each alone, fp16
# precision and bf16 compression (fp16's with another dtype) run under -m soak, for the suite's
# time on 2 cores. fp16 precision goes through a heal in CI below (the overflow test).
@pytest.mark.parametrize("strategy", [pytest.param(Strategy(precision="bf16"), marks=pytest.mark.soak),
                                      pytest.param(Strategy(precision="fp16"), marks=pytest.mark.soak),
                                      pytest.param(Strategy(compression="fp16"), marks=pytest.mark.soak),
                                      pytest.param(Strategy(compression="bf16"), marks=pytest.mark.soak),
                                      Strategy(precision="bf16", compression="fp16")],
                         ids=["bf16", "fp16", "compress-fp16", "compress-bf16", "bf16-compress-fp16"])
def test_reduced_precision_ends_within_one_percent_of_fp32_through_a_heal(local_ray, tmp_path, ddp_reference,
                                                                          strategy):
    result = _fit(tmp_path, "precision", ScalingConfig(min_workers=1, max_workers=2), strategy,
                  faults=[Fault(kind="kill", rank=1, step=10, where="allreduce")], dtype="float32")
    assert result.events_of("recovery"), "no heal"
    reference = ddp_reference["float32"]["final_loss"]
    assert abs(result.value["final_loss"] - reference) <= 0.01 * reference
    if strategy.compression != "none":
        assert result.value["comm_bytes"] > 0


# Under ZeRO-1 in CI: the skip is DDP's spread inf either way; plain DDP under -m soak.
@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.soak), 1])
def test_an_fp16_overflow_skips_the_step_on_every_rank_and_the_scaler_stays_shared_through_a_heal(local_ray, tmp_path,
                                                                                                  zero):
    # Rank 1's loss is inf at step 6: DDP spreads the inf to every rank's gradient, every
    # rank skips that step and halves its scale (the loop checks both and raises otherwise).
    # Under ZeRO-1 the skipped step still counts for the shards, so the heal at step 12 finds
    # the dead rank's shard of step 12 in its buddy copy.
    result = _fit(tmp_path, "overflow", ScalingConfig(min_workers=1, max_workers=2),
                  Strategy(precision="fp16", zero=zero), faults=[Fault(kind="kill", rank=1, step=12)],
                  dtype="float32", inf_at=(1, 6), optimizer="adamw" if zero else "sgd")
    assert 6 in result.value["skipped"]
    assert [e["kind"] for e in result.events_of("generation_formed")][:2] == ["start", "heal"]


def test_collectives_give_the_same_answers_at_world_sizes_1_2_and_3_and_a_death_inside_one_heals(local_ray, tmp_path):
    # The loop checks every collective's result at every step against what it computes
    # locally from the world size. At 3, rank 2 dies at the start of step 6 while its peers
    # wait in that step's first collective.
    # With min_workers=2 the survivors heal at 2 at once: the second run checks the collectives
    # at 3 and at 2. It is held after step 0 until its 3 workers started, so rank 2 exists at step 6.
    single = _fit(tmp_path, "collectives-1", ScalingConfig(min_workers=1, max_workers=1), check_collectives=True)
    result = _fit_held(tmp_path, "collectives-3", 0, workers_started(3), scaling=ScalingConfig(min_workers=2, max_workers=3),
                       faults=[Fault(kind="kill", rank=2, step=6)], check_collectives=True)
    assert result.events_of("recovery"), "no heal"
    assert set(single.value["collectives_checked"]) | set(result.value["collectives_checked"]) == {1, 2, 3}


POWERSGD = Strategy(compression="powersgd:rank=2,start_iter=3")


@pytest.mark.soak  # the suite's time on 2 cores: CI has PowerSGD through a kill (below)
def test_powersgd_through_a_planned_grow_equals_a_fixed_size_run(local_ray, tmp_path):
    # P and Q are scale-free in the world size and the error buffers are averaged, so a
    # grow changes nothing; regression_loop checks that the joiner's iter, generator, Q and
    # error buffers equal the others' at the first step of each generation.
    fixed = _fit(tmp_path, "powersgd-2", ScalingConfig(min_workers=2, max_workers=2), POWERSGD)

    grown = _fit_held(tmp_path, "powersgd-grow", 6, _grow_to_3_once_formed(), scaling=STARTS_AT_2,
                      strategy=POWERSGD)
    assert [e["world_size"] for e in grown.events_of("generation_formed")] == [2, 3]
    assert _max_diff(grown.value["params"], fixed.value["params"]) < 1e-9
    parameter_bytes = sum(v.numel() * v.element_size() for v in fixed.value["params"].values())
    assert fixed.value["comm_bytes"] < 0.5 * MAX_STEPS * parameter_bytes, "PowerSGD sent half of plain DDP or more"


def test_powersgd_through_a_kill_ends_within_two_percent_of_the_fault_free_loss(local_ray, tmp_path):
    fixed = _fit(tmp_path, "powersgd-ref", ScalingConfig(min_workers=2, max_workers=2), POWERSGD)
    healed = _fit(tmp_path, "powersgd-kill", ScalingConfig(min_workers=1, max_workers=2), POWERSGD,
                  faults=[Fault(kind="kill", rank=1, step=10, where="allreduce")])
    assert healed.events_of("recovery"), "no heal"
    assert abs(healed.value["final_loss"] - fixed.value["final_loss"]) <= 0.02 * fixed.value["final_loss"]


def test_a_death_inside_a_checkpoints_average_of_powersgds_error_feedback_heals_in_place(local_ray, tmp_path):
    # A checkpoint averages the ranks' error feedback first, a collective between steps: rank 1
    # dies as it snapshots the checkpoint of step 8, its peer inside the average. Before, the
    # peer's failure there left the loop as its error, and the run failed.
    result = _fit(tmp_path, "powersgd-checkpoint-kill", ScalingConfig(min_workers=1, max_workers=2), POWERSGD,
                  faults=[Fault(kind="kill", rank=1, step=8, where="checkpoint")],
                  checkpoint=CheckpointConfig(every_steps=4))
    [recovery] = result.events_of("recovery")
    assert recovery["steps_lost"] == 0 and not recovery["from_checkpoint"], recovery
    assert result.step == MAX_STEPS and result.checkpoint.step == MAX_STEPS
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)


ZERO = Strategy(zero=1)


def test_zero_3_at_shares_whose_micro_batches_would_differ_in_count_trains_as_plain_adamw(local_ray, tmp_path):
    # 64 samples at 3 ranks are shares of 22, 21 and 21; cut by sevens alone they made 4, 3 and
    # 3 micro-batches, and FSDP's gathers in each forward never matched (a crash loop). Every rank
    # now makes the largest share's count.
    steps = 8
    result = _fit(tmp_path, "zero3-micro", ScalingConfig(num_workers=3), Strategy(zero=3), max_steps=steps,
                  micro_batch_size=7, optimizer="adamw")
    assert result.step == steps and not result.events_of("worker_failed")
    assert _max_diff(result.value["params"], regression_reference(steps, seed=0, optimizer="adamw")["params"]) < 1e-9


def test_zero_1_equals_ddp_through_a_grow_and_a_kill_with_the_dead_ranks_shard_from_its_buddy(local_ray, tmp_path,
                                                                                                ddp_reference):
    # Start at 2 (another actor holds the third CPU's worth), grow to 3 once it goes, then
    # rank 1 dies at step 16: its shard of the AdamW state lives on in rank 2's buddy copy.
    result = _fit_held(tmp_path, "zero", 4, _grow_to_3_once_formed(), scaling=STARTS_AT_2,
                       strategy=ZERO, faults=[Fault(kind="kill", rank=1, step=16)], optimizer="adamw")
    kinds = [(e["kind"], e["world_size"]) for e in result.events_of("generation_formed")]
    assert kinds[:3] == [("start", 2), ("grow", 3), ("heal", 2)], kinds
    assert _max_diff(result.value["params"], ddp_reference["adamw"]["params"]) < 1e-9


# Both stages run under -m soak, for the suite's time on 2 cores: tests/test_fsdp.py checks ZeRO-2
# and ZeRO-3 against plain AdamW through a grow, a death and a resume at another size in CI, in gloo
# processes; ZeRO-1 runs through Ray in CI (the buddy test above).
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.soak), pytest.param(3, marks=pytest.mark.soak)])
def test_zero_2_and_3_on_fsdp2_equal_ddp_through_a_grow_and_a_kill(local_ray, tmp_path, ddp_reference, stage):
    # As ZeRO-1's test: each generation shards a fresh FSDP2 module over its group, filled with
    # the shards (parameters and AdamW state) moved point to point; rank 1's come from its buddy.
    result = _fit_held(tmp_path, f"zero{stage}", 4, _grow_to_3_once_formed(), scaling=STARTS_AT_2,
                       strategy=Strategy(zero=stage), faults=[Fault(kind="kill", rank=1, step=16)], optimizer="adamw")
    kinds = [(e["kind"], e["world_size"]) for e in result.events_of("generation_formed")]
    assert kinds[:3] == [("start", 2), ("grow", 3), ("heal", 2)], kinds
    # The loop's params are its ctx.model_state_dict(), the shards gathered on every rank.
    assert _max_diff(result.value["params"], ddp_reference["adamw"]["params"]) < 1e-9
    assert _max_diff(result.model_state_dict(), ddp_reference["adamw"]["params"]) < 1e-9
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)


def test_zero_without_buddy_copies_restarts_a_death_from_the_latest_checkpoint_exactly(local_ray, tmp_path,
                                                                                      ddp_reference):
    # zero_replicas=0: rank 1's shard dies with it, so the survivor cannot heal in place; the
    # run restarts from the checkpoint at step 8 and replays, still equal to DDP.
    result = _fit(tmp_path, "zero-r0", ScalingConfig(min_workers=1, max_workers=2), Strategy(zero=1, zero_replicas=0),
                  faults=[Fault(kind="kill", rank=1, step=12)], optimizer="adamw",
                  checkpoint=CheckpointConfig(every_steps=8), hold_for_checkpoint=(11, 8, str(tmp_path / "zero-r0")))
    [restart] = [d for d in result.events_of("decision") if d["action"] == "RESTART"]
    assert "lost part of the run's state" in restart["reason"] and "ShardLostError" in restart["reason"]
    [recovery] = result.events_of("recovery")
    assert recovery["from_checkpoint"]
    assert [e["step"] for e in result.events_of("generation_formed") if e["kind"] == "restart"] == [8]
    assert _max_diff(result.value["params"], ddp_reference["adamw"]["params"]) < 1e-9
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)


# Under -m soak (the suite's time on 2 cores): ZeRO-1's pieces resume across sizes in
# tests/test_zero.py, ZeRO-3's checkpoint written at 3 resumes at 2 in tests/test_fsdp.py, and a
# ZeRO run restarts from its checkpoint through Ray below.
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.soak), pytest.param(3, marks=pytest.mark.soak)])
def test_a_zero_checkpoint_written_by_3_ranks_resumes_at_2_exactly(local_ray, tmp_path, ddp_reference, stage):
    def run(workers, max_steps):
        return ElasticTrainer(
            regression_loop,
            train_loop_config={"max_steps": MAX_STEPS, "optimizer": "adamw"},
            scaling_config=ScalingConfig(min_workers=workers, max_workers=workers),
            run_config=RunConfig(name="zero-resume", storage_path=str(tmp_path),
                                 checkpoint_config=CheckpointConfig(every_steps=8)),
            data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=32, max_steps=max_steps),
            strategy=Strategy(zero=stage), show_progress=False,
        ).fit()

    first = run(3, 16)
    assert first.checkpoint is not None and first.checkpoint.world_size == 3
    resumed = run(2, MAX_STEPS)
    assert resumed.events_of("generation_formed")[0]["step"] == 16, "did not resume from step 16"
    assert _max_diff(resumed.value["params"], ddp_reference["adamw"]["params"]) < 1e-9


def test_a_checkpoint_without_optimizer_shards_does_not_resume_a_zero_run(local_ray, tmp_path):
    def run(strategy, max_steps, workers):
        return ElasticTrainer(
            regression_loop, train_loop_config={"max_steps": MAX_STEPS, "optimizer": "adamw"},
            scaling_config=ScalingConfig(num_workers=workers),
            run_config=RunConfig(name="mixed", storage_path=str(tmp_path),
                                 checkpoint_config=CheckpointConfig(every_steps=8)),
            data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=32, max_steps=max_steps),
            strategy=strategy, show_progress=False,
        ).fit()

    run(Strategy(), 8, workers=1)  # what the checkpoint holds does not depend on how many wrote it
    with pytest.raises(TrainingFailedError, match=r"holds no sharded optimizer state: it was written without "
                       r"Strategy\(zero=1, 2 or 3\); resume it with the same strategy"):
        run(ZERO, MAX_STEPS, workers=2)


SLOW_STEP_S = 0.25  # a sleep inside each step, standing for seconds of compute (as in the chaos matrix)


# Every case runs under `-m soak` (the suite's time on 2 cores). CI has heals through Fault kills
# (EASGD's and local SGD's rollbacks to the last sync, which DiLoCo's shares; the ZeRO-1 buddy;
# PowerSGD), ZeRO-3 through a death in tests/test_fsdp.py, and a slow-step outside SIGKILL through
# the chaos matrix (a newcomer's, inside a 0.25 s step).
@pytest.mark.parametrize("strategy", [
    pytest.param(Strategy(sync="diloco:every=8"), marks=pytest.mark.soak),
    pytest.param(Strategy(sync="easgd:every=8"), marks=pytest.mark.soak),
    pytest.param(ZERO, marks=pytest.mark.soak),
    pytest.param(Strategy(zero=3), marks=pytest.mark.soak),
    pytest.param(POWERSGD, marks=pytest.mark.soak),
], ids=["diloco", "easgd", "zero", "zero3", "powersgd"])
def test_slow_steps_heal_a_sigkill_sent_from_outside_at_a_moment_inside_a_step(local_ray, tmp_path, ddp_reference,
                                                                               strategy):
    # From step 12 on, rank 1's process is killed at a random moment of a step: mid-interval
    # for DiLoCo and EASGD, anywhere in the forward, the gradient sync, PowerSGD's factors or
    # ZeRO's own step.
    killer = OutsideKiller("mid-step", str(tmp_path), "sigkill", SimpleNamespace(compute_s=SLOW_STEP_S), seed=7)
    killer.start()
    result = _fit(tmp_path, "sigkill", ScalingConfig(min_workers=2, max_workers=3), strategy,
                  compute_s=SLOW_STEP_S, optimizer="adamw")
    assert killer.done.wait(60) and killer.killed, "the outside kill never happened"
    assert result.events_of("recovery"), "no heal"
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)
    if strategy.zero:
        assert _max_diff(result.value["params"], ddp_reference["adamw"]["params"]) < 1e-9

