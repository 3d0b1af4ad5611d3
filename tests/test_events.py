"""The event journal writes only what is new: appends on a local disk, segments on S3.

No Ray. The S3 tests use a real S3-compatible server (the `s3` fixture of conftest.py: moto in
server mode on a free local port), reached through pyarrow.fs.S3FileSystem.
"""

import json
import logging
import os
import pathlib
import re
import threading
import time

import pyarrow.fs as pafs
import pytest

from elastic.checkpoint.storage import RunStorage
from elastic.journal.events import EVENT_TYPES, EventJournal, has_journal, read_events, segment_name
from elastic.journal.resume import resume
from held_store import HeldStore

pytestmark = pytest.mark.timeout(120)

BUCKET = "journal-tests"


@pytest.fixture
def local(tmp_path):
    storage = RunStorage(str(tmp_path), "run")
    storage.check_writable()
    return storage


@pytest.fixture(scope="module")
def s3fs(s3):
    fs = pafs.S3FileSystem(endpoint_override=s3, scheme="http", access_key="testing", secret_key="testing",
                           region="us-east-1", allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    return fs


def _on_s3(s3fs, name):
    storage = RunStorage(f"{BUCKET}/runs", name, s3fs)
    storage.check_writable()
    return storage


def _emit(journal, steps):
    for step in steps:
        journal.emit("metrics", step=step)


def _steps(storage):
    return [e["step"] for e in read_events(storage)]


def _tamper(storage, relative):
    """Marks every event in a stored file; a writer that rewrites the file would lose the mark."""
    lines = storage.read_text(relative).splitlines()
    marked = "".join(json.dumps({**json.loads(line), "marked": True}) + "\n" for line in lines)
    with storage.fs.open_output_stream(storage.path(relative)) as out:
        out.write(marked.encode())


def test_a_local_flush_appends_to_the_same_file_and_leaves_its_earlier_bytes_alone(local):
    journal = EventJournal(local)
    _emit(journal, range(3))
    journal.flush()
    path = local.path(EventJournal.FILE)
    inode = os.stat(path).st_ino
    _tamper(local, EventJournal.FILE)
    first = open(path, "rb").read()

    _emit(journal, range(3, 5))
    journal.flush()

    after = open(path, "rb").read()
    assert after.startswith(first) and after.count(b"\n") == 5
    assert os.stat(path).st_ino == inode
    assert [e.get("marked", False) for e in read_events(local)] == [True] * 3 + [False] * 2


def test_every_event_is_read_back_once_in_order_after_many_flushes(local):
    journal = EventJournal(local)
    step = 0
    for batch in [1, 4, 0, 2, 7, 0, 1]:
        _emit(journal, range(step, step + batch))
        step += batch
        journal.flush()
    assert _steps(local) == list(range(step))
    assert journal.events == read_events(local)


def test_a_reader_ignores_a_last_line_that_is_still_being_written(local):
    complete = "".join(json.dumps({"type": "metrics", "time": 1.0, "step": s}) + "\n" for s in range(2))
    local.write_text_atomic(EventJournal.FILE, complete + '{"type": "metr')
    assert _steps(local) == [0, 1]


def test_a_journal_over_a_torn_last_line_writes_its_events_on_lines_of_their_own(local):
    complete = "".join(json.dumps({"type": "metrics", "time": 1.0, "step": s}) + "\n" for s in range(2))
    local.write_text_atomic(EventJournal.FILE, complete + '{"type": "metr')  # a crash mid-append
    journal = EventJournal(local, read_events(local))
    _emit(journal, [2])
    journal.flush()
    assert _steps(local) == [0, 1, 2]


def test_a_journal_over_an_existing_run_writes_only_its_own_events(local):
    first = EventJournal(local)
    _emit(first, range(3))
    first.flush()

    second = EventJournal(local, read_events(local))  # a restarted controller, or a resumed run
    _emit(second, [3])
    second.flush()

    assert _steps(local) == [0, 1, 2, 3]
    assert [e["step"] for e in second.events] == [0, 1, 2, 3]


def _attempt(journal, attempt, generations, failures, fault):
    journal.emit("run_started", attempt=attempt)
    for generation in generations:
        journal.emit("state", state="FORMING", generation=generation)
    journal.emit("decision", action="HEAL", failures=failures)
    journal.emit("fault_injected", fault=fault, attempt=attempt)


def test_a_restarted_controller_continues_its_attempts_generations_failures_and_fired_faults(local):
    journal = EventJournal(local)
    _attempt(journal, "first", [0, 1, 2, 3, 4, 5], 3, "kill:1:10")
    _attempt(journal, "second", [0, 1], 1, "kill:0:5")
    journal.flush()
    resumed = resume(read_events(local), "second")
    assert resumed.restarted
    assert (resumed.generation, resumed.failures, resumed.fired) == (1, 1, ("kill:0:5",)), \
        "the earlier attempt's generations, failures or faults leaked into this one"


def test_a_new_attempt_of_the_same_run_starts_its_generations_and_failures_afresh(local):
    journal = EventJournal(local)
    _attempt(journal, "first", [0, 1, 2], 2, "kill:1:10")
    journal.flush()
    resumed = resume(read_events(local), "new")
    assert not resumed.restarted
    assert (resumed.generation, resumed.failures, resumed.fired) == (-1, 0, ())


def test_events_emitted_by_many_threads_during_flushes_are_each_written_once(local):
    journal = EventJournal(local)
    threads, per_thread, done = 4, 200, threading.Event()

    def emitter(t):
        for i in range(per_thread):
            journal.emit("metrics", step=t * per_thread + i)

    def flusher():
        while not done.is_set():
            journal.flush()

    flushing = threading.Thread(target=flusher)
    flushing.start()
    emitting = [threading.Thread(target=emitter, args=(t,)) for t in range(threads)]
    for thread in emitting:
        thread.start()
    for thread in emitting:
        thread.join()
    done.set()
    flushing.join()
    journal.flush()

    steps = _steps(local)
    assert sorted(steps) == list(range(threads * per_thread))
    for t in range(threads):  # each thread's events keep their order
        own = [s for s in steps if s // per_thread == t]
        assert own == sorted(own)


def test_a_local_run_that_already_has_segments_keeps_writing_segments_after_them(local):
    # A run copied down from an object store: events.jsonl, then segment 0.
    local.write_text_atomic(EventJournal.FILE, json.dumps({"type": "metrics", "time": 1.0, "step": 0}) + "\n")
    local.write_bytes(segment_name(0), (json.dumps({"type": "metrics", "time": 2.0, "step": 1}) + "\n").encode())
    journal = EventJournal(local, read_events(local))
    _emit(journal, [2])
    journal.flush()
    assert local.size(segment_name(1)) is not None
    assert _steps(local) == [0, 1, 2]


def test_on_s3_each_flush_is_a_new_segment_and_no_flush_rewrites_an_earlier_one(s3fs):
    storage = _on_s3(s3fs, "segments")
    journal = EventJournal(storage)
    assert not has_journal(storage)
    _emit(journal, range(2))
    journal.flush()
    _tamper(storage, segment_name(0))
    _emit(journal, range(2, 5))
    journal.flush()
    _tamper(storage, segment_name(1))
    _emit(journal, [5])
    journal.flush()
    journal.flush()  # nothing new: no segment

    listed = s3fs.get_file_info(pafs.FileSelector(storage.path("events")))
    assert sorted(i.base_name for i in listed) == ["000000000000.jsonl", "000000000001.jsonl", "000000000002.jsonl"]
    assert storage.size(EventJournal.FILE) is None
    assert has_journal(storage)
    events = read_events(storage)
    assert [e["step"] for e in events] == list(range(6))
    assert [e.get("marked", False) for e in events] == [True] * 5 + [False]


def test_a_second_journal_over_the_same_s3_run_continues_the_sequence(s3fs):
    storage = _on_s3(s3fs, "restarted")
    first = EventJournal(storage)
    for step in range(2):
        _emit(first, [step])
        first.flush()
    _tamper(storage, segment_name(0))
    _tamper(storage, segment_name(1))

    second = EventJournal(storage, read_events(storage))  # the controller restarted
    _emit(second, [2, 3])
    second.flush()

    assert storage.size(segment_name(2)) is not None and storage.size(segment_name(3)) is None
    events = read_events(storage)
    assert [e["step"] for e in events] == [0, 1, 2, 3]
    assert [e.get("marked", False) for e in events] == [True, True, False, False]


def test_an_s3_run_journaled_before_segments_reads_its_events_jsonl_first(s3fs):
    storage = _on_s3(s3fs, "older")
    storage.write_text_atomic(EventJournal.FILE, json.dumps({"type": "metrics", "time": 1.0, "step": 0}) + "\n")
    journal = EventJournal(storage, read_events(storage))
    _emit(journal, [1])
    journal.flush()
    assert storage.read_text(EventJournal.FILE).count("\n") == 1
    assert _steps(storage) == [0, 1]


def test_a_failure_decision_recovery_or_state_is_due_for_a_flush_at_once_and_metrics_wait(local):
    journal = EventJournal(local)
    _emit(journal, [1, 2])
    assert not journal.due, "metrics alone asked for a flush"
    for prompt in ("worker_failed", "decision", "recovery", "state", "fenced"):
        journal.emit(prompt)
        assert journal.due, f"{prompt} waited for the periodic flush"
        journal.flush()
        assert not journal.due
    assert [e["type"] for e in read_events(local)][-1] == "fenced"


def test_every_event_type_the_controller_and_the_protocol_emit_is_known(local):
    # An unknown type raises where it is emitted: in the controller, that loses the call it serves.
    root = pathlib.Path(__file__).parent.parent
    sources = [*root.joinpath("elastic").rglob("*.py"), *root.joinpath("actors").rglob("*.py")]
    emitted = {m for path in sources for m in re.findall(r'[eE]mit\("([a-z_]+)"', path.read_text())}
    assert emitted and emitted <= set(EVENT_TYPES), f"unknown event types: {sorted(emitted - set(EVENT_TYPES))}"


def test_while_the_store_stops_answering_the_events_wait_in_memory_and_are_written_in_order_once_it_answers(tmp_path):
    store = HeldStore()
    storage = RunStorage(str(tmp_path), "run", pafs.PyFileSystem(store))
    journal = EventJournal(storage, retry_s=0.01)
    journal.emit("state", state="RUNNING")
    journal.flush()
    store.hold()
    for step in range(5):
        journal.emit("recovery", step=step)
        journal.flush_soon()  # returns while the store holds the journal's write
    while not store.waiting:
        time.sleep(0.01)
    assert journal.unwritten == 5 and [e["step"] for e in journal.events[1:]] == list(range(5))
    store.release()
    while journal.unwritten:
        time.sleep(0.01)
    assert [e.get("step") for e in read_events(storage)] == [None, 0, 1, 2, 3, 4]


def test_a_flush_that_fails_keeps_its_events_and_the_journal_writes_them_when_the_store_is_back(tmp_path):
    folder = tmp_path / "run"
    folder.write_text("a file where the run folder should be: every write fails")
    storage = RunStorage(str(tmp_path), "run")
    journal = EventJournal(storage, retry_s=0.01)
    journal.emit("state", state="RUNNING")
    journal.flush_soon()
    while journal.flush_error is None:
        time.sleep(0.01)
    assert journal.unwritten == 1
    # Emitted while the store is still away: once a retry succeeds the thread waits for the next
    # flush_soon, so an event emitted after that success would wait for it too.
    journal.emit("state", state="FINISHED")
    assert journal.unwritten == 2
    folder.unlink()  # the store is back
    while journal.unwritten:
        time.sleep(0.01)
    assert [e["state"] for e in read_events(storage)] == ["RUNNING", "FINISHED"]
    assert journal.flush_error is None


def test_every_event_is_also_logged_and_what_went_wrong_as_a_warning(local, caplog):
    journal = EventJournal(local)
    with caplog.at_level(logging.DEBUG, logger="elastic"):
        journal.emit("state", state="RUNNING")
        journal.emit("worker_failed", worker_id=1, kind="death", cause="gone")
        journal.emit("metrics", step=3)
    logged = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert logged == [("elastic.journal.events", "INFO", 'state {"state": "RUNNING"}'),
                      ("elastic.journal.events", "WARNING", 'worker_failed {"worker_id": 1, "kind": "death", "cause": "gone"}'),
                      ("elastic.journal.events", "DEBUG", 'metrics {"step": 3}')]
