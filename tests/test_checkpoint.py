"""The checkpoint format on a local pyarrow filesystem: sharded writes, manifest last, damage.

No Ray: two "ranks" write their shards of one snapshot through CheckpointWriter, and the
test plays the controller by writing the manifest once both have reported.
"""

import hashlib
import io
import json
import os
import pickle
import time

import pyarrow.fs as pafs
import pytest
import safetensors.torch
import torch

from elastic import DataConfig, ElasticTrainer, RunConfig, ScalingConfig
from elastic.checkpoint import checkpoint as checkpoint_module
from elastic.checkpoint import tensor_file
from elastic.checkpoint.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointWriter,
    check_resume_keeps_history,
    checkpoint_storage,
    latest_complete,
    shard_chunks,
    shard_name,
    step_dir,
    steps_to_delete,
    take_snapshot,
    verify,
    write_manifest,
)
from elastic.checkpoint.host_buffers import HostBuffers
from elastic.checkpoint.shards import ShardCollector
from elastic.checkpoint.storage import RunStorage, StorageError
from elastic.comm.state_sync import state_of
from elastic.errors import ElasticError
from held_store import HeldStore


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 5)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(run, step, world_size=2, files=None, metadata=None, generation=0, seed=None, attempt=""):
    model, optimizer = _model_and_optimizer(step if seed is None else seed)
    states = {"model": state_of(model), "optimizer": state_of(optimizer)}
    snapshot = take_snapshot(states, {"step": step, "cursor": {"epoch": 1, "consumed": 8 * step, "seed": 0}})
    reports = []
    writer = CheckpointWriter(run, on_written=reports.append)
    for rank in range(world_size):
        writer.submit(snapshot, rank, world_size, 0.0, files or {}, metadata or {}, generation=generation)
        writer.wait()
    assert all("error" not in r for r in reports)
    write_manifest(run, snapshot.progress, world_size, [f for r in reports for f in r["files"]], metadata or {},
                   attempt)
    return model, optimizer


@pytest.fixture
def run(tmp_path):
    return RunStorage(str(tmp_path), "run")


def test_a_saved_checkpoint_loads_back_to_the_same_model_optimizer_and_cursor(run):
    model, optimizer = _save(run, 10, world_size=3)
    checkpoint = Checkpoint.from_path(f"{run.root}/{step_dir(10)}")
    assert (checkpoint.step, checkpoint.world_size, checkpoint.cursor["consumed"]) == (10, 3, 80)
    state = checkpoint.load_state()
    fresh, fresh_optimizer = _model_and_optimizer(seed=99)
    fresh.load_state_dict(state["model"])
    fresh_optimizer.load_state_dict(state["optimizer"])
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert state["progress"]["step"] == 10


def test_the_manifest_lists_every_file_with_size_and_sha256(run):
    _save(run, 4, world_size=2, files={"vocab.txt": b"abc"})
    manifest = Checkpoint.from_path(f"{run.root}/{step_dir(4)}").manifest
    names = [f["name"] for f in manifest["files"]]
    assert names == [shard_name(0, 2), shard_name(1, 2), "user/vocab.txt"]
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"])
    assert manifest["format_version"] == 3 and manifest["world_size"] == 2
    assert [f["path"] for f in manifest["files"]] == [f"gen-0/{name}" for name in names]


def test_a_writer_of_a_generation_that_moved_on_never_overwrites_a_file_a_manifest_lists(run):
    # Generation 3 (2 ranks) completes step 4's checkpoint. A rank of generation 2, cut off
    # before it ended, then writes its shard of step 4 (same rank, same world size, other state)
    # into the same storage: it lands in generation 2's folder, which no manifest lists.
    model, _ = _save(run, 4, generation=3)
    reports = []
    stale, _ = _model_and_optimizer(seed=99)
    snapshot = take_snapshot({"model": state_of(stale)}, {"step": 4, "cursor": {"epoch": 1, "consumed": 32, "seed": 0}})
    writer = CheckpointWriter(run, on_written=reports.append)
    writer.submit(snapshot, 1, 2, 0.0, {}, {}, generation=2)
    writer.wait()
    assert run.size(f"{step_dir(4)}/gen-2/{shard_name(1, 2)}") is not None, "the stale write did not happen"
    state = Checkpoint.from_path(run.path(step_dir(4))).load_state()  # verifies every listed file's sha256
    for name, tensor in model.state_dict().items():
        assert torch.equal(state["model"][name], tensor)


def test_shards_written_from_each_ranks_own_share_load_back_to_the_whole_state(run):
    model, optimizer = _model_and_optimizer()
    extra = {"strided": torch.arange(12.0).reshape(3, 4).t(), "half": torch.arange(5, dtype=torch.bfloat16),
             "count": torch.tensor(7), "complex": torch.tensor([1 + 2j, 3j])}  # complex: stored as bytes
    states = {"model": state_of(model), "optimizer": state_of(optimizer), "extra": extra}
    progress = {"step": 5, "cursor": {"epoch": 0, "consumed": 40, "seed": 0}}
    reports = []
    writer = CheckpointWriter(run, on_written=reports.append)
    for rank in range(3):
        writer.submit(take_snapshot(states, progress, rank, 3), rank, 3, 0.0, {}, {})
        writer.wait()
    write_manifest(run, progress, 3, [f for r in reports for f in r["files"]], {})
    state = Checkpoint.from_path(run.path(step_dir(5))).load_state()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state["model"][name], tensor)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    for name, tensor in extra.items():
        assert state["extra"][name].dtype == tensor.dtype and torch.equal(state["extra"][name], tensor)


def test_a_snapshot_of_one_ranks_share_refuses_to_write_another_ranks_shard(run):
    reports = []
    writer = CheckpointWriter(run, on_written=reports.append)
    writer.submit(take_snapshot({"t": torch.ones(4)}, {"step": 1, "cursor": {}}, 0, 2), 1, 2, 0.0, {}, {})
    writer.wait()
    assert "holds the share of rank 0 of 2, not of rank 1 of 2" in reports[0]["error"]


def test_user_files_and_metadata_come_back(run):
    _save(run, 4, files={"notes.json": b'{"a": 1}'}, metadata={"tokenizer": "bytes"})
    checkpoint = Checkpoint.from_path(f"{run.root}/{step_dir(4)}")
    assert checkpoint.read_file("notes.json") == b'{"a": 1}'
    assert checkpoint.metadata == {"tokenizer": "bytes"}


def _listed(run, step, name):
    """Where the manifest of step's checkpoint says file `name` lies."""
    return run.path(f"{step_dir(step)}/gen-0/{name}")


def _corrupt_truncate(run, step):
    path = _listed(run, step, shard_name(1, 2))
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _corrupt_flip(run, step):
    path = _listed(run, step, shard_name(0, 2))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _corrupt_no_manifest(run, step):
    run.fs.delete_file(run.path(f"{step_dir(step)}/manifest.json"))


@pytest.mark.parametrize(
    "damage, reason",
    [(_corrupt_truncate, "is truncated"), (_corrupt_flip, "wrong checksum"), (_corrupt_no_manifest, "never completed")],
)
def test_a_damaged_checkpoint_is_skipped_with_its_reason_and_the_one_before_is_used(run, damage, reason):
    _save(run, 8)
    _save(run, 16)
    damage(run, 16)
    skipped = []
    checkpoint = latest_complete(run, lambda step, why: skipped.append((step, why)))
    assert checkpoint.step == 8
    assert len(skipped) == 1 and skipped[0][0] == 16 and reason in skipped[0][1]


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files whose sha256 is checked, one entry per check."""
    names = []
    check = checkpoint_module._check_sha256

    def counting(entry, data):
        names.append(entry["name"])
        check(entry, data)

    monkeypatch.setattr(checkpoint_module, "_check_sha256", counting)
    return names


def test_a_verified_checkpoint_is_hashed_once_by_verify_and_not_again_when_loaded(run, hashed):
    _save(run, 6, world_size=3, files={"notes.json": b"{}"})
    checkpoint = Checkpoint.from_path(f"{run.root}/{step_dir(6)}")
    assert sorted(hashed) == [shard_name(r, 3) for r in range(3)] + ["user/notes.json"]
    hashed.clear()

    travelled = pickle.loads(pickle.dumps(checkpoint))  # as it reaches rank 0 through Ray
    assert travelled.load_state()["progress"]["step"] == 6
    assert travelled.read_file("notes.json") == b"{}"
    assert hashed == []


def test_a_checkpoint_that_was_not_verified_is_hashed_as_it_loads(run, hashed):
    _save(run, 6, world_size=2)
    folder = checkpoint_storage(run, 6)
    checkpoint = Checkpoint(folder, verify(folder).manifest)  # as the controller makes one after a save
    hashed.clear()
    checkpoint.load_state()
    assert hashed == [shard_name(0, 2), shard_name(1, 2)]


def test_verify_catches_a_flipped_byte_that_keeps_the_size(run):
    _save(run, 16)
    _corrupt_flip(run, 16)
    with pytest.raises(CheckpointError, match="wrong checksum"):
        Checkpoint.from_path(run.path(step_dir(16)))


def test_a_verified_checkpoint_still_catches_a_file_truncated_after_verify(run):
    _save(run, 16)
    checkpoint = Checkpoint.from_path(run.path(step_dir(16)))
    _corrupt_truncate(run, 16)
    with pytest.raises(CheckpointError, match="is truncated"):
        checkpoint.load_state()


def _write_listed(run, step, files, format_version):
    """A checkpoint of `files` (name -> bytes) as a writer of `format_version` left it."""
    folder = checkpoint_storage(run, step)
    run.fs.create_dir(folder.root, recursive=True)
    for name, data in files.items():
        folder.write_bytes(name, data)
    listed = [{"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
              for name, data in files.items()]
    write_manifest(run, {"step": step, "cursor": {"epoch": 0, "consumed": 8 * step, "seed": 0}}, len(files), listed, {})
    path = run.path(f"{step_dir(step)}/manifest.json")
    manifest = json.loads(open(path).read())
    open(path, "w").write(json.dumps({**manifest, "format_version": format_version}))
    return folder


@pytest.mark.parametrize("format_version", [2, 3])
def test_a_checkpoint_cannot_run_code_when_loaded(run, tmp_path, format_version):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    if format_version == 2:  # the structure in a torch.save shard
        payload = io.BytesIO()
        torch.save({"chunks": {}, "structure": Exploit()}, payload, pickle_module=pickle)
        name, data = "shard-00000-of-00001.pt", payload.getvalue()
    else:  # the structure in a safetensors shard's metadata
        name, data = shard_name(0, 1), b"".join(tensor_file.encode({"float32": [torch.ones(2)]}, Exploit()))
    folder = _write_listed(run, 2, {name: data}, format_version)
    with pytest.raises(pickle.UnpicklingError):
        Checkpoint.from_path(folder.root).load_state()
    assert not marker.exists()


def test_a_checkpoint_of_format_version_2_still_loads(run):
    # Format 2 wrote each shard with torch.save, under the name ending in .pt.
    model, optimizer = _model_and_optimizer()
    states = {"model": state_of(model), "optimizer": state_of(optimizer)}
    snapshot = take_snapshot(states, {"step": 7, "cursor": {"epoch": 0, "consumed": 56, "seed": 0}})
    files = {}
    for rank in range(2):
        shard = io.BytesIO()
        torch.save({"format_version": 2, "rank": rank, "world_size": 2,
                    "chunks": {k: v.clone() for k, v in shard_chunks(snapshot, rank, 2).items()},
                    "structure": snapshot.structure if rank == 0 else None}, shard)
        files[f"shard-{rank:05d}-of-00002.pt"] = shard.getvalue()
    folder = _write_listed(run, 7, files, 2)
    state = Checkpoint.from_path(folder.root).load_state()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state["model"][name], tensor)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_every_shard_is_a_safetensors_file_any_safetensors_reader_opens(run):
    model, _ = _save(run, 4, world_size=2)
    flat = torch.cat([t.reshape(-1) for t in model.state_dict().values()])
    read = [safetensors.torch.load_file(run.path(f"{step_dir(4)}/gen-0/{shard_name(rank, 2)}")) for rank in range(2)]
    assert torch.equal(torch.cat([shard["float32"] for shard in read])[: flat.numel()], flat)


@pytest.mark.parametrize("manifest", ["[]", '{"format_version": 3}', '{"format_version": 3, "files": [{"name": "x"}]}'])
def test_a_manifest_of_another_shape_is_refused_as_not_a_checkpoint_and_skipped_by_resume(run, manifest):
    _save(run, 3)
    _save(run, 5)
    with open(run.path(f"{step_dir(5)}/manifest.json"), "w") as edited:
        edited.write(manifest)
    with pytest.raises(CheckpointError, match="is not a manifest elastic wrote"):
        Checkpoint.from_path(run.path(step_dir(5)))
    skipped = []
    assert latest_complete(run, lambda step, reason: skipped.append(step)).step == 3 and skipped == [5]


def test_two_attempts_checkpointing_one_step_in_one_generation_write_apart_and_a_stale_one_writes_no_manifest(run):
    # A run resumed by name restarts its generation numbers at 0: without the attempt in the path,
    # its shards overwrote those of the folder's earlier manifests.
    snapshot = take_snapshot({"t": torch.ones(4)}, {"step": 8, "cursor": {}})
    reports = {}
    for attempt in ("a" * 32, "b" * 32):
        writer = CheckpointWriter(run, on_written=lambda report, attempt=attempt: reports.update({attempt: report}),
                                  attempt=attempt)
        writer.submit(snapshot, 0, 1, 0.0, {}, {})
        writer.wait()
    assert [f["path"] for f in reports["a" * 32]["files"]] == [f"gen-0-aaaaaaaa/{shard_name(0, 1)}"]
    assert [f["path"] for f in reports["b" * 32]["files"]] == [f"gen-0-bbbbbbbb/{shard_name(0, 1)}"]
    run.write_text_atomic(".owner", "b" * 32)  # attempt b's controller took the run folder
    stale = ShardCollector(run, keep_last=2, attempt="a" * 32)
    with pytest.raises(StorageError, match="another fit\\(\\) of the run took its folder"):
        stale.add(reports["a" * 32])
    checkpoint, _ = ShardCollector(run, keep_last=2, attempt="b" * 32).add(reports["b" * 32])
    assert torch.equal(verify(checkpoint_storage(run, 8)).load_state()["t"], torch.ones(4))


def test_the_newest_checkpoint_of_an_attempt_is_found_past_newer_ones_of_another(run):
    # What a controller that Ray restarts resumes from (`Controller._resumes_from`): its own
    # attempt's newest, not step 16 of another history (tests/test_resume.py runs it through Ray).
    _save(run, 8, world_size=1, attempt="a" * 32)
    _save(run, 16, world_size=1, attempt="b" * 32)
    assert latest_complete(run, lambda step, why: None, attempt="a" * 32).step == 8
    assert latest_complete(run, lambda step, why: None).step == 16
    assert latest_complete(run, lambda step, why: None, attempt="c" * 32) is None


def test_a_file_lost_after_the_checkpoint_was_verified_fails_its_load_naming_it(run):
    _save(run, 3)
    checkpoint = Checkpoint.from_path(run.path(step_dir(3)))
    os.remove(run.path(f"{step_dir(3)}/gen-0/{shard_name(1, 2)}"))
    with pytest.raises(CheckpointError, match=f"lost its file gen-0/{shard_name(1, 2)}"):
        checkpoint.load_state()


def test_an_incompatible_format_version_names_the_mismatch(run):
    _save(run, 3)
    path = run.path(f"{step_dir(3)}/manifest.json")
    text = open(path).read().replace('"format_version": 3', '"format_version": 99')
    open(path, "w").write(text)
    with pytest.raises(CheckpointError, match="format_version 99, this elastic reads 1, 2, 3"):
        Checkpoint.from_path(run.path(step_dir(3)))


def test_retention_keeps_the_last_k_complete_and_never_the_only_complete_one():
    assert steps_to_delete([8, 16, 24, 32], complete=[8, 16, 24, 32], keep_last=2, latest=32) == [8, 16]
    assert steps_to_delete([8, 16], complete=[8], keep_last=1, latest=8) == []
    assert steps_to_delete([8, 16, 24], complete=[16], keep_last=1, latest=16) == [8]
    # A restart in flight restores step 8: it stays while the restart forms, whatever keep_last says.
    assert steps_to_delete([8, 16, 24], complete=[8, 16, 24], keep_last=1, latest=24, pinned=[8]) == [16]


def test_retention_counts_from_the_runs_latest_and_leaves_newer_folders_alone():
    # Step 52 is complete on disk but not this run's latest (damaged, a resume skipped it; or past
    # an older resume_from). Counted as the newest, it deleted the run's latest (45) and the one
    # before it, and a checkpoint still being written below it.
    assert steps_to_delete([37, 45, 52], complete=[37, 45, 52], keep_last=1, latest=45) == [37]
    assert steps_to_delete([37, 41, 45, 52], complete=[37, 41, 52], keep_last=2, latest=41) == []


def test_a_storage_error_leaves_the_checkpoint_incomplete_and_is_reported(tmp_path):
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the run folder should be")
    reports = []
    writer = CheckpointWriter(RunStorage(str(blocker), "run"), on_written=reports.append)
    snapshot = take_snapshot({"t": torch.ones(3)}, {"step": 1, "cursor": {}})
    writer.submit(snapshot, 0, 1, 0.0, {}, {})
    writer.wait()
    assert "error" in reports[0]


def _until(condition):
    while not condition():
        time.sleep(0.01)


def test_a_store_that_stops_answering_never_holds_up_submit_and_a_newer_snapshot_replaces_one_still_waiting(tmp_path):
    store = HeldStore()
    run = RunStorage(str(tmp_path), "run", pafs.PyFileSystem(store))
    reports = []
    writer = CheckpointWriter(run, on_written=reports.append)
    pool = HostBuffers()
    snapshots = {step: take_snapshot({"t": torch.full((3,), float(step))}, {"step": step, "cursor": {}}, pool=pool)
                 for step in (10, 20, 30)}
    store.hold()
    writer.submit(snapshots[10], 0, 1, 0.0, {}, {})
    _until(lambda: store.waiting)  # step 10's upload waits on the store
    # Each returns while the store still holds step 10's write: nothing waits on it.
    writer.submit(snapshots[20], 0, 1, 0.0, {}, {})
    writer.submit(snapshots[30], 0, 1, 0.0, {}, {})
    assert store.waiting and not reports
    # The replaced snapshot's buffers are free for the next one at once.
    assert pool.take(torch.float32, 3, False).data_ptr() == snapshots[20].buffers["float32"].data_ptr()
    store.release()
    writer.wait()
    assert [(r["step"], "skipped" in r) for r in reports] == [(10, False), (20, True), (30, False)]
    assert "replaced it: the store is slower than the checkpoint schedule" in reports[1]["skipped"]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_10", "step_30"]


def test_a_written_snapshot_gives_its_buffers_to_the_next_and_a_snapshot_still_held_keeps_its_own(run):
    pool = HostBuffers()
    reports = []
    writer = CheckpointWriter(run, on_written=reports.append)
    state = {"w": torch.arange(6.0), "n": torch.arange(3)}
    first = take_snapshot(state, {"step": 1, "cursor": {}}, pool=pool)
    second = take_snapshot(state, {"step": 2, "cursor": {}}, pool=pool)  # the first is not written yet
    pointers = lambda snapshot: {b.data_ptr() for b in snapshot.buffers.values()}  # noqa: E731
    assert not pointers(first) & pointers(second)
    writer.submit(first, 0, 1, 0.0, {}, {})
    writer.wait()
    state["w"].add_(100)
    third = take_snapshot(state, {"step": 3, "cursor": {}}, pool=pool)
    assert pointers(third) == pointers(first), "the written snapshot's buffers were not reused"
    assert torch.equal(third.buffers["float32"], torch.arange(6.0) + 100)
    assert torch.equal(second.buffers["float32"], torch.arange(6.0)), "a held snapshot's buffers were overwritten"
    # What the first wrote is the state at step 1, though its buffers now hold step 3's.
    written = checkpoint_storage(run, 1)
    write_manifest(run, first.progress, 1, reports[0]["files"], {})
    assert torch.equal(Checkpoint(written, json.loads(written.read_text("manifest.json"))).load_state()["w"],
                       torch.arange(6.0))


def test_a_report_that_cannot_reach_the_controller_neither_stops_the_writer_nor_holds_up_its_wait(run):
    reports = []

    def on_written(report):
        if not reports:
            reports.append(None)
            raise ConnectionError("the controller is gone")
        reports.append(report)

    writer = CheckpointWriter(run, on_written=on_written)
    for step in (1, 2):
        writer.submit(take_snapshot({"t": torch.ones(2)}, {"step": step, "cursor": {}}), 0, 1, 0.0, {}, {})
        writer.wait()  # returns though the first report raised
    assert reports[0] is None and reports[1]["step"] == 2 and "error" not in reports[1]


def test_a_resume_from_that_would_overwrite_or_delete_the_run_folders_own_checkpoints_is_refused_before_anything_starts(
        tmp_path):
    def fit(name, resume_from):
        ElasticTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                       run_config=RunConfig(name=name, storage_path=str(tmp_path)),
                       data_config=DataConfig(global_batch_size=8, max_steps=20, seed=0),
                       resume_from=str(tmp_path / resume_from)).fit()

    run, other = RunStorage(str(tmp_path), "run"), RunStorage(str(tmp_path), "other")
    for step in (4, 8, 12):
        _save(run, step, world_size=1)
    _save(other, 6, world_size=1)
    manifests = {step: open(run.path(f"{step_dir(step)}/manifest.json")).read() for step in (4, 8, 12)}
    # Rolled back in place: its steps 8 and 12 would be written over by another history.
    with pytest.raises(ElasticError, match=r"resume_from is step 4 of this run, whose folder .* holds later checkpoints "
                                           r"\(steps 8, 12\).*new RunConfig\(name=...\)"):
        fit("run", f"run/{step_dir(4)}")
    # Another run's checkpoint into this folder: retention would delete 4, 8 and 12 as the run went on.
    with pytest.raises(ElasticError, match=r"holds checkpoints of its own \(steps 4, 8, 12\), and resume_from names "
                                           r"another run's"):
        fit("run", f"other/{step_dir(6)}")
    assert {step: open(run.path(f"{step_dir(step)}/manifest.json")).read() for step in (4, 8, 12)} == manifests
    # Its own latest (by any path: a symlink), and another run's checkpoint into a new folder, are taken.
    os.symlink(tmp_path, tmp_path / "link")
    check_resume_keeps_history(run, Checkpoint.from_path(str(tmp_path / "link" / "run" / step_dir(12))))
    check_resume_keeps_history(RunStorage(str(tmp_path), "branch"), Checkpoint.from_path(run.path(step_dir(4))))
    # A later checkpoint that is damaged holds nothing a resume could lose.
    for shard in (tmp_path / "run" / step_dir(12)).rglob("*.safetensors"):
        shard.write_bytes(b"torn")
    check_resume_keeps_history(run, Checkpoint.from_path(run.path(step_dir(8))))


def test_a_resume_past_max_steps_is_refused_before_any_worker_starts(run):
    _save(run, 10, world_size=1)
    trainer = ElasticTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                             run_config=RunConfig(name="run", storage_path=run.root.rsplit("/", 1)[0]),
                             data_config=DataConfig(global_batch_size=8, max_steps=4, seed=0))
    with pytest.raises(ElasticError, match=r"at step 10, past DataConfig\(max_steps=4\): there is nothing to train"):
        trainer.fit()  # before: actors started, and the run ended at step 10 of 4 without a word


def test_a_resume_inside_an_epoch_with_another_data_seed_is_refused_before_any_worker_starts(run):
    _save(run, 10, world_size=1)  # 80 samples into epoch 1 of the order seed 0 shuffled
    trainer = ElasticTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                             run_config=RunConfig(name="run", storage_path=run.root.rsplit("/", 1)[0]),
                             data_config=DataConfig(global_batch_size=8, max_steps=20, seed=5))
    with pytest.raises(ElasticError, match=r"stopped 80 samples into epoch 1 of the order DataConfig\(seed=0\) "
                                           r"shuffled, and this run asks seed=5.*Resume with DataConfig\(seed=0\)"):
        trainer.fit()  # raised before ray.init and the controller: nothing of the run started
