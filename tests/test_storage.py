"""A run's folder stays inside storage_path, on local storage and on S3 (moto in server mode).

`RunConfig` refuses a name that is not one plain folder name; `RunStorage`, the one place that
joins a folder to storage_path, refuses any folder that some reader would place outside it, so
even a config that skipped validation writes nothing outside storage_path.
"""

import os
import socket
import uuid

import pyarrow.fs as pafs
import pytest
from pydantic import ValidationError

from elastic import DataConfig, ElasticTrainer, RunConfig, ScalingConfig
from elastic.trainer import located
from elastic.checkpoint.checkpoint import checkpoint_storage
from elastic.checkpoint.storage import RunStorage, StorageError

pytestmark = pytest.mark.timeout(60)

HOSTILE_NAMES = [
    "..", ".", "a/../..", "%2e%2e", "..%2F", "%2F", "%252e%252e", "/abs", "a\\b", "a\nb", "a\x00b", "",
]
BUCKET = "hostile"
# Where an absolute name would land on local storage, outside the folder the test lists.
ABSOLUTE_TARGET = "/abs"


def _loop():
    pass


def _fit(run_config):
    ElasticTrainer(
        _loop, scaling_config=ScalingConfig(), run_config=run_config,
        data_config=DataConfig(global_batch_size=8, micro_batch_size=4, max_steps=1), show_progress=False,
    ).fit()


def _s3_filesystem(endpoint, **options):
    return pafs.S3FileSystem(
        endpoint_override=endpoint, scheme="http", access_key="testing", secret_key="testing", region="us-east-1",
        **options,
    )


def _listing(fs, base):
    """Every file and folder under `base`, with its size and modification time."""
    return sorted((i.path, i.size, i.mtime) for i in fs.get_file_info(pafs.FileSelector(base, recursive=True)))


@pytest.fixture(params=["local", "local-uri", "s3-filesystem", "s3-uri"])
def storage(request, tmp_path):
    """(storage_path, storage_filesystem, snapshot): snapshot() lists everything a run could escape to."""
    if request.param.startswith("local"):
        runs = tmp_path / "runs"
        # A sibling run with a checkpoint: retention in an escaped run folder would delete it.
        (tmp_path / "runs" / "other" / "checkpoints" / "step_1").mkdir(parents=True)
        (tmp_path / "runs" / "other" / "checkpoints" / "step_1" / "manifest.json").write_text("{}")
        fs = pafs.LocalFileSystem()
        path = str(runs) if request.param == "local" else f"file://{runs}"
        return path, None, lambda: (_listing(fs, str(tmp_path)), os.path.exists(ABSOLUTE_TARGET))
    endpoint = request.getfixturevalue("s3")
    fs = _s3_filesystem(endpoint, allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    # A prefix of its own per test, so that a write which escaped creates a key the listing shows.
    team = f"{BUCKET}/team-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(f"{team}/runs/other/checkpoints/step_1/manifest.json") as out:
        out.write(b"{}")
    # The bucket list too: an absolute name would be read as another bucket.
    snapshot = lambda: (_listing(fs, BUCKET), sorted(i.path for i in fs.get_file_info(pafs.FileSelector("/"))))
    if request.param == "s3-filesystem":
        return f"{team}/runs", _s3_filesystem(endpoint), snapshot
    uri = f"s3://testing:testing@{team}/runs?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    return uri, None, snapshot


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_a_run_name_that_is_not_one_plain_folder_name_is_rejected_and_nothing_is_written_outside_storage_path(
    storage, name
):
    storage_path, filesystem, snapshot = storage
    before = snapshot()
    with pytest.raises(ValidationError, match="a run name must be one plain folder name") as rejected:
        RunConfig(name=name, storage_path=storage_path, storage_filesystem=filesystem)
    assert rejected.value.errors()[0]["loc"] == ("name",)
    # A config that skipped validation still cannot escape: RunStorage refuses the folder itself.
    unchecked = RunConfig.model_construct(name=name, storage_path=storage_path, storage_filesystem=filesystem)
    with pytest.raises(StorageError, match="is not a safe folder inside storage_path"):
        _fit(unchecked)
    assert snapshot() == before


def test_plain_run_names_and_the_folders_below_a_run_are_accepted(tmp_path):
    run = RunStorage(str(tmp_path), "lm-1.v2")
    assert run.root == f"{tmp_path}/lm-1.v2"
    assert checkpoint_storage(run, 16).root == f"{tmp_path}/lm-1.v2/checkpoints/step_16"
    assert RunStorage(f"{tmp_path}/x/../runs", "lm").root == f"{tmp_path}/runs/lm"


def test_a_folder_below_the_run_cannot_climb_out_either(tmp_path):
    run = RunStorage(str(tmp_path / "runs"), "lm")
    with pytest.raises(StorageError, match=r"resolves to '.*/runs/elsewhere', outside storage_path"):
        RunStorage(run.root, "checkpoints/../../elsewhere")


def test_a_worker_writes_checkpoints_only_into_the_folder_its_runs_controller_took(tmp_path):
    folder = RunStorage(str(tmp_path), "run")
    folder.check_writable()
    # A local storage_path on another node: that node's own folder, which the controller never wrote to.
    with pytest.raises(StorageError, match="storage_path is a local path each node has its own copy of"):
        folder.check_shared("a" * 32, node="node-2")
    folder.write_text_atomic(".owner", "b" * 32)
    with pytest.raises(StorageError, match="another fit\\(\\) of the run took its folder .*attempt bbbbbbbb"):
        folder.check_shared("a" * 32, node="node-2")
    folder.write_text_atomic(".owner", "a" * 32)
    assert folder.check_shared("a" * 32, node="node-2") is None
    # A store that fails this node's write (no credentials here, or a passing error) is told, not fatal.
    (tmp_path / "a-file").write_text("")
    failing = RunStorage(str(tmp_path / "a-file"), "run")
    assert "cannot use the run folder" in failing.check_shared("a" * 32, node="node-2")


def test_a_relative_storage_path_is_made_the_drivers_before_the_controller_gets_it(tmp_path, monkeypatch):
    # Resolved again in the controller's working directory (another node's, or the folder
    # `ray start` ran in), it put the run where the driver's resume checks never looked.
    monkeypatch.chdir(tmp_path)
    assert located(RunConfig(name="r", storage_path="runs")).storage_path == str(tmp_path / "runs")
    for kept in (RunConfig(name="r", storage_path="s3://bucket/runs"), RunConfig(name="r", storage_path=str(tmp_path))):
        assert located(kept) is kept


def test_a_store_that_takes_connections_and_never_answers_fails_the_write_check_naming_it():
    # A stalled endpoint (a proxy that holds connections): fit() stood still in its first call.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{silent.getsockname()[1]}", scheme="http",
                               access_key="testing", secret_key="testing", region="us-east-1")
        with pytest.raises(StorageError, match=r"did not answer a write within 0.5 s: check its endpoint"):
            RunStorage("bucket/runs", "r", fs).check_writable(within_s=0.5)
    finally:
        silent.close()
