"""Checkpoints and the journal on S3: a real S3-compatible server (moto, in server mode) on a
free local port, reached through pyarrow.fs.S3FileSystem with an endpoint override.
"""

import pyarrow.fs as pafs
import pytest

from elastic import CheckpointConfig, DataConfig, ElasticTrainer, RunConfig, ScalingConfig
from elastic.checkpoint.checkpoint import Checkpoint
from elastic.checkpoint.storage import RunStorage, StorageError
from elastic.journal.events import read_events
from workloads import GLOBAL_BATCH, regression_loop

pytestmark = pytest.mark.timeout(240)


def _filesystem(endpoint, **options):
    return pafs.S3FileSystem(
        endpoint_override=endpoint, scheme="http", access_key="testing", secret_key="testing", region="us-east-1",
        **options,
    )


def _trainer(s3, max_steps, workers):
    s3 = _filesystem(s3)
    return ElasticTrainer(
        regression_loop,
        train_loop_config={"max_steps": 32},
        scaling_config=ScalingConfig(min_workers=workers, max_workers=workers),
        run_config=RunConfig(
            name="on-s3", storage_path="elastic-runs/team", storage_filesystem=s3,
            checkpoint_config=CheckpointConfig(every_steps=8, keep_last=1),
        ),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=32, max_steps=max_steps),
        show_progress=False,
    )


def test_checkpoints_and_events_live_on_s3_and_a_second_run_resumes_from_them(local_ray, s3):
    endpoint, s3 = s3, _filesystem(s3)
    _filesystem(endpoint, allow_bucket_creation=True).create_dir("elastic-runs")
    first = _trainer(endpoint, 16, 2).fit()
    assert first.checkpoint.step == 16
    second = _trainer(endpoint, 32, 1).fit()
    assert second.events_of("run_resumed")[-1]["step"] == 16
    assert second.events_of("generation_formed")[0]["step"] == 16, "the second run retrained instead of resuming"
    assert second.step == 32
    run = RunStorage("elastic-runs/team", "on-s3", s3)
    events = read_events(run)
    assert [e["step"] for e in events if e["type"] == "checkpoint_saved"] == [8, 16, 24, 32]
    # keep_last=1: only the newest complete checkpoint is left in the bucket.
    listed = s3.get_file_info(pafs.FileSelector("elastic-runs/team/on-s3/checkpoints"))
    assert [i.base_name for i in listed] == ["step_32"]
    state = Checkpoint.from_path("elastic-runs/team/on-s3/checkpoints/step_32", s3).load_state()
    assert state["progress"]["step"] == 32


def test_a_bucket_that_does_not_exist_fails_before_anything_starts(s3):
    strict = _filesystem(s3, allow_bucket_creation=False)
    with pytest.raises(StorageError, match="cannot write to the run folder"):
        RunStorage("no-such-bucket/prefix", "run", strict).check_writable()
