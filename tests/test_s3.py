"""Checkpoints and the journal on S3: a real S3-compatible server (moto, in server mode) on a
free local port, reached through pyarrow.fs.S3FileSystem with an endpoint override; for a store
that stops answering, one in a process of its own, frozen with SIGSTOP (`elastic.s3_server`).
"""

import pyarrow.fs as pafs
import pytest
import torch

from elastic import CheckpointConfig, DataConfig, ElasticTrainer, RunConfig, ScalingConfig
from elastic.checkpoint.checkpoint import (MANIFEST, Checkpoint, checkpoint_steps, checkpoint_storage,
                                           latest_complete, verify)
from elastic.checkpoint.storage import RunStorage, StorageError
from elastic.journal.events import read_events
from elastic.s3_server import S3Server
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


def _frozen_store_run(tmp_path, freeze_s: float):
    """Two workers at 0.05 s steps, a checkpoint every EVERY steps, on an S3 server that is frozen
    (SIGSTOP) for `freeze_s` once step FREEZE_AT committed: (result, the run's storage, when each
    step committed, the freeze's start and end)."""
    log = tmp_path / "steps.log"

    with S3Server() as server:
        fs = server.filesystem(connect_timeout=1, request_timeout=2)
        server.filesystem(allow_bucket_creation=True).create_dir("bucket")
        freeze = server.freeze_when(lambda: log.exists() and len(log.read_text().splitlines()) >= FREEZE_AT, freeze_s)
        result = ElasticTrainer(
            regression_loop,
            train_loop_config={"max_steps": STALL_STEPS, "sleep_s": 0.05, "step_log": str(log)},
            scaling_config=ScalingConfig(min_workers=2, max_workers=2),
            run_config=RunConfig(name="frozen-store", storage_path="bucket/runs", storage_filesystem=fs,
                                 checkpoint_config=CheckpointConfig(every_steps=EVERY, keep_last=100)),
            data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=32, max_steps=STALL_STEPS),
            show_progress=False,
        ).fit()
        freeze.join()
        committed = {int(s): float(t) for s, t in (line.split() for line in log.read_text().splitlines())}
        yield result, RunStorage("bucket/runs", "frozen-store", fs), committed, {"frozen": freeze.frozen,
                                                                                "thawed": freeze.thawed}


FREEZE_AT, EVERY, STALL_STEPS = 40, 10, 160


def test_a_frozen_store_never_stalls_training_and_every_event_and_checkpoint_lands_once_it_thaws(local_ray, tmp_path):
    for result, run, committed, window in _frozen_store_run(tmp_path, freeze_s=5):
        before = [t for s, t in committed.items() if FREEZE_AT - 30 <= s <= FREEZE_AT]
        during = [s for s, t in committed.items() if window["frozen"] < t < window["thawed"]]
        pace_before = (len(before) - 1) / (before[-1] - before[0])
        pace_during = len(during) / (window["thawed"] - window["frozen"])
        # The old writer made the next checkpoint wait for the frozen upload: EVERY steps at most.
        assert len(during) > 3 * EVERY and pace_during > pace_before / 2, (pace_before, pace_during, len(during))

        assert result.step == STALL_STEPS
        ledger = result.value["ledger"]
        assert torch.equal(ledger, torch.ones_like(ledger)), "a sample was lost or trained twice"
        skipped = result.events_of("checkpoint_skipped")
        assert skipped and all(window["frozen"] < e["time"] for e in skipped), skipped
        saved = [e["step"] for e in result.events_of("checkpoint_saved")]
        thawed_at = max(s for s, t in committed.items() if t < window["thawed"])
        assert any(step > thawed_at for step in saved) and saved[-1] == STALL_STEPS, (saved, thawed_at)

        # Events emitted while the store was away reached it once it answered, in order, once each.
        stored = read_events(run)
        assert stored[-len(result.events):] == result.events
        assert any(window["frozen"] < e["time"] < window["thawed"] for e in stored)
        # Every checkpoint with a manifest is whole; a resume starts from the newest.
        for step in checkpoint_steps(run):
            folder = checkpoint_storage(run, step)
            if folder.size(MANIFEST) is not None:
                verify(folder)
        assert latest_complete(run, lambda step, reason: None).step == STALL_STEPS
