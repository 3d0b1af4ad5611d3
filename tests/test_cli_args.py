"""`elastic demo` argument handling: usage errors exit 2 with a fix, and never start Ray."""

import json
import math

import pytest

from elastic import cli
from elastic.demo.train import DemoConfig, worker_gpu_share
from elastic.errors import ElasticError
from elastic.faults import Fault

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def runs(monkeypatch):
    """Stands in for run_demo: records each config it gets and returns a canned summary."""
    configs = []

    def fake_run_demo(config):
        configs.append(config)
        return {
            "name": config.name, "storage_path": config.storage_path, "events": "runs/demo/events.jsonl",
            "steps": config.steps, "samples": config.steps * config.global_batch_size, "wall_s": 70.0,
            "world_size_history": [
                {"time": 100.0, "world_size": 3, "generation": 0, "reason": "start: 3 ready workers"},
                {"time": 118.0, "world_size": 2, "generation": 1, "reason": "heal: 2 live members"},
            ],
            "recoveries": [{"seconds": 0.4, "steps_lost": 1}], "goodput": 0.8,
            "first_loss": 4.9, "final_loss": 2.3, "loss_curve": [], "faults": [f.spec() for f in config.faults],
            "checkpoint": None, "resumed_from_step": None,
        }

    monkeypatch.setattr(cli, "run_demo", fake_run_demo)
    return configs


def usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_bad_inject_spec_exits_2_with_the_parse_message(runs, capsys):
    err = usage_error(["demo", "--inject", "kill:rank=1"], capsys)

    assert "bad fault 'kill:rank=1': step: Field required" in err
    assert runs == []


def test_unknown_fault_kind_names_the_known_kinds(runs, capsys):
    assert "known kinds: kill" in usage_error(["demo", "--inject", "explode:rank=1,step=2"], capsys)


def test_inject_step_beyond_the_last_step_is_rejected(runs, capsys):
    err = usage_error(["demo", "--steps", "10", "--inject", "kill:rank=1,step=10"], capsys)

    assert "use a step below 10" in err
    assert runs == []


def test_inject_rank_beyond_max_workers_is_rejected(runs, capsys):
    assert "use a rank below 3" in usage_error(["demo", "--inject", "kill:rank=3,step=5"], capsys)


def test_min_workers_above_max_workers_is_rejected(runs, capsys):
    assert "min_workers(4) > max_workers(3)" in usage_error(["demo", "--min-workers", "4"], capsys)


def test_inject_none_cannot_be_combined_with_faults(runs, capsys):
    err = usage_error(["demo", "--inject", "none", "--inject", "kill:rank=1,step=3"], capsys)

    assert "cannot be combined" in err


def test_without_inject_rank_1_dies_a_quarter_in_and_the_user_is_told(runs, capsys):
    assert cli.main(["demo", "--steps", "100"]) == 0

    assert runs[0].faults == [Fault(kind="kill", rank=1, step=25)]
    assert "--inject none" in capsys.readouterr().out


def test_inject_none_runs_without_faults(runs):
    assert cli.main(["demo", "--inject", "none"]) == 0

    assert runs[0].faults == []


def test_given_faults_replace_the_default(runs):
    cli.main(["demo", "--inject", "kill:rank=0,step=5", "--inject", "kill:rank=2,step=9,where=allreduce"])

    assert [f.spec() for f in runs[0].faults] == ["kill:rank=0,step=5", "kill:rank=2,step=9,where=allreduce"]


def test_summary_json_is_written_and_summarized(runs, tmp_path, capsys):
    path = tmp_path / "summary.json"

    assert cli.main(["demo", "--inject", "none", "--summary-json", str(path), "--name", "mine"]) == 0

    summary = json.loads(path.read_text())
    assert summary["name"] == "mine" and summary["recoveries"] == [{"seconds": 0.4, "steps_lost": 1}]
    out = capsys.readouterr().out
    assert "3 (start at 0s) -> 2 (heal at 18s)" in out
    assert str(path) in out


def test_pipeline_stages_make_one_to_two_replicas_and_the_default_fault_kills_a_stage_worker(runs, capsys):
    assert cli.main(["demo", "--pipeline-stages", "2", "--steps", "60"]) == 0

    config = runs[0]
    assert (config.pipeline_stages, config.min_workers, config.max_workers) == (2, 2, 4)
    assert config.faults == [Fault(kind="kill", rank=1, step=15)]
    assert "rank 1 (stage 1 of replica 0) will be killed at step 15" in capsys.readouterr().out


def test_pipeline_stages_with_a_partial_replica_are_rejected_naming_the_multiple(runs, capsys):
    err = usage_error(["demo", "--pipeline-stages", "2", "--max-workers", "3"], capsys)

    assert "max_workers(3) is not a whole number of replicas of pipeline_stages(2) workers: give a multiple of 2" in err
    assert runs == []


def test_more_pipeline_stages_than_the_lm_has_layers_are_rejected(runs, capsys):
    err = usage_error(["demo", "--pipeline-stages", "5"], capsys)

    assert "would cut the LM into 5 parts, but it has 4 layers" in err and "use at most 4 pipeline stages" in err


def test_a_technique_pipelined_replicas_do_not_run_is_rejected(runs, capsys):
    assert "is not built" in usage_error(["demo", "--pipeline-stages", "2", "--precision", "bf16"], capsys)


def test_tensor_parallel_that_does_not_divide_the_heads_or_a_partial_replica_is_rejected(runs, capsys):
    err = usage_error(["demo", "--tensor-parallel", "3"], capsys)
    assert "tensor_parallel(3) does not divide the LM's 4 attention heads" in err
    err = usage_error(["demo", "--tensor-parallel", "2", "--max-workers", "3"], capsys)
    assert "max_workers(3) is not a whole number of replicas of tensor_parallel(2) workers: give a multiple of 2" in err
    assert runs == []


def test_the_demo_refuses_pipeline_stages_and_tensor_parallel_together(runs, capsys):
    err = usage_error(["demo", "--pipeline-stages", "2", "--tensor-parallel", "2"], capsys)
    assert "the demo runs pipeline_stages or tensor_parallel, not both" in err
    assert runs == []


def test_use_gpu_shares_the_gpus_among_the_demos_workers(runs):
    assert cli.main(["demo", "--use-gpu", "--inject", "none"]) == 0
    config = runs[0]
    assert config.use_gpu
    resources = config.scaling_config(gpus=1).worker_resources()
    assert resources["GPU"] == pytest.approx(1 / 3) and config.scaling_config(gpus=1).use_gpu
    assert not DemoConfig().scaling_config().use_gpu


@pytest.mark.parametrize("gpus, share", [(1, 1 / 3), (2, 1 / 2), (3, 1.0), (8, 1.0)])
def test_each_demo_worker_gets_a_share_of_a_gpu_that_lets_all_three_fit(gpus, share):
    assert worker_gpu_share(gpus, 3) == pytest.approx(share)
    assert math.floor(1 / share) * gpus >= 3  # whole shares per GPU, times the GPUs, hold every worker


def test_use_gpu_without_a_gpu_in_the_cluster_is_refused_naming_the_fix():
    with pytest.raises(ElasticError, match="has 0 GPUs: drop --use-gpu, or run it on a machine or Ray cluster"):
        worker_gpu_share(0, 3)


def test_use_gpu_with_an_overlapped_optimizer_is_a_usage_error_before_ray_starts(runs, capsys):
    error = usage_error(["demo", "--use-gpu", "--overlap-optimizer"], capsys)
    assert "overlap_optimizer=True) with use_gpu=True is not built" in error and not runs
