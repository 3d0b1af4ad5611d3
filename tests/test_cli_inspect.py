"""`elastic status|events|checkpoints` read a run folder written in the real on-disk format,
without Ray; unknown runs and bad paths are one line on stderr with status 1."""

import hashlib
import json

import pytest

from elastic import cli
from elastic.checkpoint.checkpoint import MANIFEST, step_dir, write_manifest
from elastic.checkpoint.storage import RunStorage
from elastic.journal.events import EventJournal, make_event, read_events, segment_name
from elastic.journal.run_view import RECENT_EVENTS, list_checkpoints, open_run, run_status

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000.0
MEMBERS = [{"worker_id": w, "pid": 100 + w, "node": "n" * 56} for w in range(3)]


def healed_run_events(attempt: str = "a1", start: float = T0, max_steps: int = 100) -> list[dict]:
    """One attempt that meets every kind of mark: a death healed in place, regrowth, every
    worker lost (restart from a checkpoint), a controller restart, checkpoints, and the end."""
    script = [
        (0.0, "run_started", dict(name="lm", attempt=attempt, data={"max_steps": max_steps, "global_batch_size": 32})),
        (0.1, "state", dict(state="WAITING", reason="waiting for min_workers to be ready", generation=-1)),
        *[(5.0 + w / 10, "worker_started", dict(worker_id=w, node="n" * 56, pid=100 + w, host="vm")) for w in range(3)],
        (5.3, "state", dict(state="RECONFIGURING", reason="start: 3 ready workers", generation=0)),
        (5.4, "generation_formed", dict(generation=0, world_size=3, reason="start: 3 ready workers", seconds=0.1,
                                        source_rank=0, step=0, members=MEMBERS)),
        (5.4, "state", dict(state="RUNNING", reason="start: 3 ready workers", generation=0)),
        (7.0, "metrics", dict(world_size=3, step=5, samples_per_s=90.0, metrics={"step": 5, "loss": 5.0})),
        (9.0, "metrics", dict(world_size=3, step=15, samples_per_s=150.0, metrics={"step": 15, "loss": 4.0})),
        (10.0, "checkpoint_saved", dict(step=20, bytes=1000, stall_s=0.01, upload_s=0.05, path="x/step_20")),
        (11.0, "fault_injected", dict(worker_id=1, fault="kill:rank=1,step=25", step=25, attempt=attempt)),
        (11.1, "worker_failed", dict(worker_id=1, rank=1, node="n" * 56, pid=101, kind="death",
                                     cause="ActorDiedError: worker process died", generation=0)),
        (11.1, "decision", dict(action="HEAL", reason="a worker died; the survivors heal in place")),
        (11.1, "rescale", dict(generation=1, from_size=3, to_size=2, reason="heal: 2 live members and 0 ready newcomers")),
        (11.1, "state", dict(state="RECONFIGURING", reason="heal: 2 live members and 0 ready newcomers", generation=1)),
        (11.5, "generation_formed", dict(generation=1, world_size=2, reason="heal: 2 live members and 0 ready newcomers",
                                         seconds=0.4, source_rank=0, step=25, members=MEMBERS[::2])),
        (11.5, "recovery", dict(generation=1, seconds=0.4, steps_lost=1, world_size=2, from_checkpoint=False)),
        (11.5, "state", dict(state="RUNNING", reason="heal: 2 live members and 0 ready newcomers", generation=1)),
        (13.0, "metrics", dict(world_size=2, step=30, samples_per_s=100.0, metrics={"step": 30, "loss": 3.5})),
        (16.0, "worker_started", dict(worker_id=3, node="n" * 56, pid=103, host="vm")),
        (16.0, "rescale", dict(generation=2, from_size=2, to_size=3, reason="grow: 1 ready newcomers, 2 -> 3 workers")),
        (16.1, "generation_formed", dict(generation=2, world_size=3, reason="grow: 1 ready newcomers, 2 -> 3 workers",
                                         seconds=0.1, source_rank=0, step=40, members=MEMBERS)),
        (16.1, "state", dict(state="RUNNING", reason="grow: 1 ready newcomers, 2 -> 3 workers", generation=2)),
        (18.0, "metrics", dict(world_size=3, step=50, samples_per_s=160.0, metrics={"step": 50, "loss": 3.0})),
        (20.0, "worker_failed", dict(worker_id=0, rank=0, node="n" * 56, pid=100, kind="death",
                                     cause="ActorDiedError: worker process died", generation=2)),
        (20.0, "decision", dict(action="HEAL", reason="every worker was lost; restart from the latest checkpoint")),
        (24.0, "generation_formed", dict(generation=3, world_size=3, reason="start: 3 ready workers", seconds=4.0,
                                         source_rank=0, step=20, members=MEMBERS)),
        (24.0, "recovery", dict(generation=3, seconds=4.0, steps_lost=35, world_size=3, from_checkpoint=True)),
        (26.0, "controller_restarted", dict(reason="the controller actor died and Ray restarted it")),
        (26.0, "run_started", dict(name="lm", attempt=attempt, data={"max_steps": max_steps, "global_batch_size": 32})),
        (26.1, "checkpoint_skipped", dict(step=60, reason="checkpoints/step_60 has no manifest.json")),
        (28.0, "generation_formed", dict(generation=0, world_size=3, reason="start: 3 ready workers", seconds=0.2,
                                         source_rank=0, step=50, members=MEMBERS)),
        (30.0, "metrics", dict(world_size=3, step=90, samples_per_s=170.0, metrics={"step": 90, "loss": 2.5})),
        (31.0, "checkpoint_saved", dict(step=100, bytes=1000, stall_s=0.01, upload_s=0.05, path="x/step_100")),
        (31.0, "state", dict(state="FINISHED", reason="rank 0 finished its train loop at step 100", generation=0)),
        (31.1, "run_finished", dict(step=100, goodput=0.75, wall_s=31.1)),
    ]
    events = []
    for offset, type, fields in script:
        event = make_event(type, **fields)
        event["time"] = start + offset
        events.append(event)
    return events


def write_journal(storage_path, name: str, events: list[dict]) -> RunStorage:
    """Writes `events` as a controller continuing a run does: the earlier ones are stored, and
    an EventJournal opened over them appends the last one to events.jsonl."""
    storage = RunStorage(str(storage_path), name)
    storage.check_writable()
    *earlier, last = events
    storage.write_text_atomic(EventJournal.FILE, "".join(json.dumps(e) + "\n" for e in earlier))
    journal = EventJournal(storage, read_events(storage))
    journal.emit(last["type"], **{k: v for k, v in last.items() if k not in ("type", "time")})
    journal.flush()
    # emit stamps the current time; keep the scripted one so the timeline is deterministic.
    lines = storage.read_text(EventJournal.FILE).splitlines()
    lines[-1] = json.dumps(last)
    storage.write_text_atomic(EventJournal.FILE, "\n".join(lines) + "\n")
    return storage


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def runs(tmp_path):
    write_journal(tmp_path, "lm", healed_run_events())
    return tmp_path


def test_status_of_a_finished_run_shows_state_world_size_step_goodput_and_recent_events(runs, capsys):
    code, out, _ = run_cli(["status", "lm", "--storage-path", str(runs)], capsys)

    assert code == 0
    assert "state:       FINISHED" in out
    assert "step:        100 / 100" in out
    assert "world size:  3 (generation 0)" in out
    assert "goodput:     0.75 over 31 s" in out
    assert "loss:        2.5000" in out
    recent = out.split("recent events:\n")[1].splitlines()
    assert len(recent) == RECENT_EVENTS
    assert "run_finished" in recent[-1] and "checkpoint_saved" in recent[-3]
    assert not any("metrics" in line for line in recent)


def test_status_of_a_resumed_run_describes_only_its_latest_attempt(tmp_path):
    second = [
        (0.0, "run_started", dict(name="lm", attempt="a2", data={"max_steps": 200})),
        (0.1, "run_resumed", dict(step=100, checkpoint="x/step_100")),
        (0.2, "state", dict(state="WAITING", reason="waiting for min_workers to be ready", generation=-1)),
        (5.0, "generation_formed", dict(generation=0, world_size=2, reason="start: 2 ready workers", seconds=0.1,
                                        source_rank=0, step=100, members=MEMBERS[:2])),
        (5.0, "state", dict(state="RUNNING", reason="start: 2 ready workers", generation=0)),
        (8.0, "metrics", dict(world_size=2, step=130, samples_per_s=120.0, metrics={"step": 130, "loss": 2.0})),
    ]
    events = healed_run_events("a1") + [{**make_event(t, **f), "time": T0 + 100 + o} for o, t, f in second]
    write_journal(tmp_path, "lm", events)

    status = run_status(open_run(str(tmp_path), "lm").events, now=T0 + 110)

    assert (status.state, status.step, status.max_steps, status.world_size) == ("RUNNING", 130, 200, 2)
    assert (status.attempts, status.resumed_from_step, status.goodput, status.loss) == (2, 100, None, 2.0)
    assert status.started == T0 + 100


def test_status_of_a_silent_unfinished_run_says_its_driver_may_have_stopped(runs):
    events = healed_run_events()[:10]

    assert "may have stopped" not in run_status(events, now=events[-1]["time"] + 5).reason
    assert "no event for 10 min" in run_status(events, now=events[-1]["time"] + 600).reason


def test_status_of_a_failed_run_shows_the_error(tmp_path, capsys):
    events = healed_run_events()[:10] + [{**make_event("run_failed", error="rank 1 raised ValueError"), "time": T0 + 12}]
    write_journal(tmp_path, "lm", events)

    code, out, _ = run_cli(["status", "lm", "--storage-path", str(tmp_path)], capsys)

    assert code == 0
    assert "state:       FAILED (rank 1 raised ValueError)" in out


def test_events_filters_by_type_and_shortens_members_to_worker_ids(runs, capsys):
    code, out, _ = run_cli(["events", "lm", "--storage-path", str(runs), "--type", "worker_failed",
                            "--type", "generation_formed"], capsys)

    lines = out.splitlines()
    assert code == 0
    assert [line.split()[3] for line in lines] == ["generation_formed", "worker_failed", "generation_formed",
                                                   "generation_formed", "worker_failed", "generation_formed",
                                                   "generation_formed"]
    assert "members=[0, 2]" in lines[2] and "+11.5s" in lines[2]
    assert "node=nnnnnnnnnnnn…" in lines[1]


def test_events_json_prints_the_stored_events_unchanged(runs, capsys):
    code, out, _ = run_cli(["events", "lm", "--storage-path", str(runs), "--json", "--type", "recovery"], capsys)

    stored = [e for e in healed_run_events() if e["type"] == "recovery"]
    assert code == 0
    assert [json.loads(line) for line in out.splitlines()] == stored


def test_events_rejects_an_unknown_type_as_a_usage_error(runs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["events", "lm", "--storage-path", str(runs), "--type", "explosion"])

    assert exit_info.value.code == 2
    assert "invalid choice: 'explosion'" in capsys.readouterr().err


def write_checkpoint(storage: RunStorage, step: int, files: dict[str, bytes], manifest: bool = True) -> None:
    entries = []
    for name, data in files.items():
        storage.write_bytes(f"{step_dir(step)}/{name}", data)
        entries.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    if manifest:
        # The controller's own writer: `checkpoints/step_<N>/manifest.json` in the run folder.
        write_manifest(storage, {"step": step, "cursor": {"epoch": 0, "consumed": step * 32, "seed": 0}}, 2, entries, {})


def test_checkpoints_lists_complete_ones_with_size_and_damaged_ones_with_the_reason(runs, capsys):
    storage = RunStorage(str(runs), "lm")
    shards = {"shard-00000-of-00002.pt": b"a" * 700, "shard-00001-of-00002.pt": b"b" * 300}
    write_checkpoint(storage, 10, shards)
    write_checkpoint(storage, 20, shards)
    storage.write_bytes(f"{step_dir(20)}/shard-00001-of-00002.pt", b"b" * 10)  # truncated after the manifest
    write_checkpoint(storage, 30, shards, manifest=False)  # a crash before the manifest

    complete, damaged = list_checkpoints(storage)
    code, out, _ = run_cli(["checkpoints", "lm", "--storage-path", str(runs)], capsys)

    assert [(c.step, c.world_size, c.bytes) for c in complete] == [(10, 2, 1000)]
    assert [d.step for d in damaged] == [20, 30]
    assert "truncated: 10 bytes, manifest says 300" in damaged[0].reason
    assert f"no {MANIFEST}" in damaged[1].reason
    assert code == 0
    assert "complete checkpoints of lm" in out and ": 1\n" in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["10"])
    assert row.split()[:3] == ["10", "2", "1000"] and "ago" in row
    assert "step 20: file shard-00001-of-00002.pt is truncated" in out
    assert "step 30:" in out and "never completed" in out


def test_checkpoints_of_a_run_without_any_says_so(runs, capsys):
    code, out, _ = run_cli(["checkpoints", "lm", "--storage-path", str(runs)], capsys)

    assert code == 0
    assert "run lm has no checkpoints" in out


@pytest.mark.parametrize("command", ["status", "events", "checkpoints", "plot"])
def test_an_unknown_run_is_one_line_on_stderr_naming_the_runs_there(runs, capsys, command):
    code, out, err = run_cli([command, "nope", "--storage-path", str(runs)], capsys)

    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert f"elastic {command}: no run 'nope' under" in err and "runs there: lm" in err


def test_a_run_journaled_in_segments_only_is_found_listed_and_read_in_order(runs, capsys):
    # As an object store holds it (copied down here): no events.jsonl, only events/ segments.
    storage = RunStorage(str(runs), "on-s3")
    for sequence, event in enumerate(healed_run_events()):
        storage.write_bytes(segment_name(sequence), (json.dumps(event) + "\n").encode())

    code, out, _ = run_cli(["events", "on-s3", "--storage-path", str(runs), "--json"], capsys)
    assert code == 0
    assert [json.loads(line) for line in out.splitlines()] == healed_run_events()
    _, _, err = run_cli(["status", "nope", "--storage-path", str(runs)], capsys)
    assert "runs there: lm, on-s3" in err


def test_a_storage_path_that_does_not_exist_is_one_line_saying_to_pass_storage_path(tmp_path, capsys):
    code, _, err = run_cli(["status", "lm", "--storage-path", str(tmp_path / "missing")], capsys)

    assert code == 1 and err.count("\n") == 1
    assert "does not exist; pass --storage-path" in err


def test_a_storage_uri_pyarrow_cannot_use_is_one_line_with_status_1(capsys):
    code, _, err = run_cli(["status", "lm", "--storage-path", "nosuchscheme://bucket/runs"], capsys)

    assert code == 1 and err.count("\n") == 1
    assert "is not usable" in err


def test_a_damaged_journal_is_reported_instead_of_a_traceback(runs, capsys):
    storage = RunStorage(str(runs), "lm")
    storage.write_text_atomic(EventJournal.FILE, storage.read_text(EventJournal.FILE) + "{not json\n")

    code, _, err = run_cli(["status", "lm", "--storage-path", str(runs)], capsys)

    assert code == 1 and err.count("\n") == 1
    assert "is not JSON" in err
