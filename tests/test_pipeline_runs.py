"""Runs of replicas: replicas of 2 pipeline stages, of 2 tensor-parallel ranks, or of both (2 x 2),
are the elastic unit (real Ray actors, gloo; one local Ray of 8 logical CPUs).

dp=2 x pp=2 and dp=2 x tp=2 on 4 workers, dp=2 x pp=2 x tp=2 on 8, float64 with Tanh and AdamW. A replica's worker dies
(an injected kill at millisecond steps, or a SIGKILL sent from this process at a moment inside a
slow step): its replica leaves whole, the other replica heals in place and carries the whole
global batch, and a new replica forms when capacity for one is back. Every sample is consumed
exactly once, and the final parameters, joined from the last checkpoint's parts (stages, or
tensor-parallel slices), equal one plain process trained on each step's whole global batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch

from elastic import CheckpointConfig, DataConfig, ElasticTrainer, Fault, RunConfig, ScalingConfig, Strategy
from elastic.checkpoint.checkpoint import Checkpoint, CheckpointError
from elastic.errors import ElasticError
from workloads import (GLOBAL_BATCH, STEPS_PER_EPOCH, OutsideKiller, build_3d_mlp, build_tensor_parallel_mlp,
                       fit_held, pipeline_loop, plain_reference, tensor_parallel_loop, workers_started)

MAX_STEPS = 24
SLOW_STEP_S = 0.25
REPLICA_3D = 4  # pipeline_stages x tensor_parallel


@pytest.fixture(scope="module")
def local_ray(own_ray):
    """The module's Ray: room for two replicas of 4 workers."""
    ray.init(address="local", num_cpus=2 * REPLICA_3D, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    return plain_reference(MAX_STEPS)


@pytest.fixture(scope="module")
def mlp_reference():
    return plain_reference(MAX_STEPS, build=build_tensor_parallel_mlp)


@pytest.fixture(scope="module")
def references(reference, mlp_reference):
    """The plain model of each replica shape's run, by (pipeline_stages, tensor_parallel)."""
    return {(2, 1): reference, (1, 2): mlp_reference, (2, 2): plain_reference(MAX_STEPS, build=build_3d_mlp)}


def _fit(tmp_path, name, faults=(), compute_s=0.0, resume_from=None, max_replicas=2, stop_at=MAX_STEPS,
         regrow=False, pipeline_stages=2, tensor_parallel=1):
    """The run, held at step 1 until every replica's workers started (a slow start may begin with
    one replica and grow); with `regrow`, also at step 12 until a new replica's workers started, so
    that the replica a death took out comes back before the end."""
    config = {"max_steps": MAX_STEPS, "compute_s": compute_s}  # the ledger's epochs: those of MAX_STEPS
    config["gate"] = (1, str(tmp_path / f"started-{name}"))
    size = pipeline_stages * tensor_parallel
    gates = [workers_started(size * max_replicas)]
    if regrow:
        config["gates"] = [(12, str(tmp_path / f"regrown-{name}"))]
        gates.append(workers_started(size * (max_replicas + 1)))
    trainer = ElasticTrainer(
        pipeline_loop if pipeline_stages > 1 else tensor_parallel_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(pipeline_stages=pipeline_stages, tensor_parallel=tensor_parallel, min_replicas=1,
                                     max_replicas=max_replicas),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), checkpoint_config=CheckpointConfig(every_steps=8)),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=8, max_steps=stop_at),
        strategy=Strategy(pipeline_schedule="1f1b", pipeline_microbatches=4),
        faults=list(faults),
        resume_from=resume_from,
        show_progress=False,
    )
    return fit_held(trainer, *gates)


def _assert_exactly_once(ledger):
    assert torch.equal(ledger, torch.ones(MAX_STEPS // STEPS_PER_EPOCH, ledger.shape[1], dtype=ledger.dtype))


def _max_diff(params, reference):
    assert params.keys() == reference.keys()
    return max((params[k] - reference[k]).abs().max().item() for k in reference)


def _assert_replica_left_whole_and_came_back(result, dead_rank, size=2):
    """Rank `dead_rank` died in a generation of 2 replicas of `size` workers: its replica-mates were
    taken out, the other replica healed in place, and a new replica grew the run back."""
    formed = result.events_of("generation_formed")
    before = next(e for e in formed if e["world_size"] == 2 * size)
    ids = [m["worker_id"] for m in before["members"]]
    replica = dead_rank // size * size
    lost = ids[replica:replica + size]
    mates = sorted(w for w in lost if w != ids[dead_rank])
    released = sorted(e["worker_id"] for e in result.events_of("worker_failed") if e["kind"] == "replica")
    assert released == mates, "the dead worker's replica-mates were not taken out"
    heal = next(e for e in formed if e["kind"] == "heal")
    survivors = [w for w in ids if w not in lost]
    assert [m["worker_id"] for m in heal["members"]] == survivors, "the surviving replica did not heal in place"
    assert heal["world_size"] == size
    regrown = [e for e in formed if e["generation"] > heal["generation"] and e["world_size"] == 2 * size]
    assert regrown and regrown[0]["kind"] == "grow", "no new replica joined"
    assert [m["worker_id"] for m in regrown[0]["members"]][:size] == survivors, "the survivors did not keep their ranks"
    recovery = result.events_of("recovery")
    assert recovery and not any(r["from_checkpoint"] for r in recovery), "the run restarted instead of healing"


def _assert_whole_model(result, reference):
    """The whole trained model, from the run's Result and from the loop's own ctx.model_state_dict()
    (every rank called it), equals the plain model's, names included."""
    for whole in (result.model_state_dict(), result.value["model"]):
        assert _max_diff(whole, reference) < 1e-9


# CI kills a pipelined stage inside its average (the harder moment); the soak also kills it at a
# step's start, a tensor-parallel worker at both moments, and a 3D replica's worker (below).
WHERES = [pytest.param("step_start", marks=pytest.mark.soak), "allreduce"]


@pytest.mark.parametrize("where", WHERES)
def test_a_stage_workers_death_takes_out_its_replica_the_other_heals_and_a_new_replica_joins(
        local_ray, tmp_path, reference, where):
    # At its average, stage 0 of replica 1 dies after the stage-1 average may have completed:
    # no stage of the surviving replica may step then.
    rank = 3 if where == "step_start" else 2
    result = _fit(tmp_path, "kill", faults=[Fault(kind="kill", rank=rank, step=8, where=where)], regrow=True)
    _assert_replica_left_whole_and_came_back(result, dead_rank=rank)
    _assert_exactly_once(result.value["ledger"])
    checkpoint = Checkpoint.from_path(result.checkpoint.path)
    assert checkpoint.step == MAX_STEPS and checkpoint.parts == ["stage-0", "stage-1"]
    assert _max_diff(checkpoint.model_state_dict(), reference) < 1e-9
    _assert_whole_model(result, reference)


# Both moments under `-m soak` (the suite's time on 2 cores): CI has the stage death above and
# the tensor-parallel rebind in tests/test_tensor_parallel.py.
@pytest.mark.parametrize("where", [pytest.param(where, marks=pytest.mark.soak)
                                   for where in ("step_start", "allreduce")])
def test_a_tensor_parallel_workers_death_takes_out_its_replica_the_other_heals_and_a_new_replica_joins(
        local_ray, tmp_path, mlp_reference, where):
    rank = 3 if where == "step_start" else 2
    result = _fit(tmp_path, "tp", faults=[Fault(kind="kill", rank=rank, step=8, where=where)], regrow=True,
                  pipeline_stages=1, tensor_parallel=2)
    _assert_replica_left_whole_and_came_back(result, dead_rank=rank)
    _assert_exactly_once(result.value["ledger"])
    checkpoint = Checkpoint.from_path(result.checkpoint.path)
    assert checkpoint.step == MAX_STEPS and checkpoint.parts == ["tp-0", "tp-1"]
    slices = [checkpoint.load_state(part)["model"]["tensors"] for part in checkpoint.parts]
    assert slices[1]["0.weight"].shape == (16, 16) and slices[1]["2.weight"].shape == (16, 16)  # halves of 32
    assert torch.equal(slices[0]["4.weight"], slices[1]["4.weight"]), "the whole head drifted apart across tp ranks"
    assert _max_diff(checkpoint.model_state_dict(), mlp_reference) < 1e-9
    _assert_whole_model(result, mlp_reference)


# (pipeline_stages, tensor_parallel, victim): a pipelined stage, a tensor-parallel rank, a 3D
# replica's worker. All under -m soak (the suite's time on 2 cores): CI kills a worker from
# outside inside a slow step in tests/test_chaos_matrix.py, and a pipelined replica's by Fault above.
SHAPES = [pytest.param(2, 1, 2, marks=pytest.mark.soak), pytest.param(1, 2, 2, marks=pytest.mark.soak),
          pytest.param(2, 2, 5, marks=pytest.mark.soak)]


@pytest.mark.parametrize("stages, tensor_parallel, victim", SHAPES, ids=["pp", "tp", "3d"])
def test_slow_steps_heal_a_replicas_worker_sigkilled_from_outside_inside_a_step(local_ray, tmp_path, references,
                                                                                stages, tensor_parallel, victim):
    size = stages * tensor_parallel
    killer = OutsideKiller("mid-step", str(tmp_path), "sigkill", SimpleNamespace(compute_s=SLOW_STEP_S), seed=3,
                           victim=victim, world_size=2 * size, from_step=6)
    killer.start()
    result = _fit(tmp_path, "sigkill", compute_s=SLOW_STEP_S, regrow=True, pipeline_stages=stages,
                  tensor_parallel=tensor_parallel)
    assert killer.done.wait(60) and killer.killed, "the outside kill never happened"
    _assert_replica_left_whole_and_came_back(result, dead_rank=victim, size=size)
    _assert_exactly_once(result.value["ledger"])
    plain = references[(stages, tensor_parallel)]
    assert _max_diff(Checkpoint.from_path(result.checkpoint.path).model_state_dict(), plain) < 1e-9
    _assert_whole_model(result, plain)


@pytest.fixture(scope="module")
def written(local_ray, tmp_path_factory):
    """The checkpoint a run of 2 replicas wrote at step 8."""
    checkpoint = Checkpoint.from_path(_fit(tmp_path_factory.mktemp("two"), "two", stop_at=8).checkpoint.path)
    assert checkpoint.step == 8 and checkpoint.world_size == 4 and checkpoint.parts == ["stage-0", "stage-1"]
    return checkpoint


def test_a_checkpoint_of_two_replicas_resumes_at_one_and_ends_equal_to_the_plain_model(tmp_path, written, reference):
    resumed = _fit(tmp_path, "one", resume_from=written.path, max_replicas=1)
    assert {e["world_size"] for e in resumed.events_of("generation_formed")} == {2}
    assert resumed.events_of("generation_formed")[0]["step"] == 8
    assert _max_diff(Checkpoint.from_path(resumed.checkpoint.path).model_state_dict(), reference) < 1e-9


def test_a_pipelined_checkpoint_is_refused_by_a_run_of_another_number_of_stages_before_any_worker_starts(
        tmp_path, written):
    trainer = ElasticTrainer(
        pipeline_loop, train_loop_config={"max_steps": MAX_STEPS},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="plain", storage_path=str(tmp_path)),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=8, max_steps=MAX_STEPS),
        resume_from=written.path, show_progress=False)
    with pytest.raises(ElasticError, match=r"holds the parts \['stage-0', 'stage-1'\], and this run \(pipeline_stages=1, "
                                           r"tensor_parallel=1\) restores no parts"):
        trainer.fit()
    assert not (tmp_path / "plain" / "events.jsonl").exists(), "a worker started"
    # The same, when the checkpoint is the run's own latest: a rerun of the run with other stages.
    rerun = ElasticTrainer(
        pipeline_loop, train_loop_config={"max_steps": MAX_STEPS}, scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(name="two", storage_path=written.storage.root.rsplit("/two/", 1)[0]),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=8, max_steps=MAX_STEPS),
        show_progress=False)
    with pytest.raises(ElasticError, match=r"holds the parts \['stage-0', 'stage-1'\]"):
        rerun.fit()
    with pytest.raises(CheckpointError, match="has no part 'stage-2'.*parts \\['stage-0', 'stage-1'\\]"):
        written.load_state("stage-2")


@pytest.mark.soak  # 8 workers and 4 newcomers on 2 cores; CI kills a pipelined stage above
def test_a_3d_replica_loses_a_worker_leaves_whole_and_a_new_one_joins(local_ray, tmp_path, references):
    # Replica 1's stage 0, tensor-parallel rank 1, dies inside its average.
    result = _fit(tmp_path, "3d", faults=[Fault(kind="kill", rank=5, step=8, where="allreduce")], regrow=True,
                  tensor_parallel=2)
    _assert_replica_left_whole_and_came_back(result, dead_rank=5, size=REPLICA_3D)
    _assert_exactly_once(result.value["ledger"])
    checkpoint = Checkpoint.from_path(result.checkpoint.path)
    assert checkpoint.parts == ["stage-0-tp-0", "stage-0-tp-1", "stage-1-tp-0", "stage-1-tp-1"]
    assert _max_diff(checkpoint.model_state_dict(), references[(2, 2)]) < 1e-9
    _assert_whole_model(result, references[(2, 2)])
