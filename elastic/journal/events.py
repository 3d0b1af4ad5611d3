"""The event journal of a run folder `{storage_path}/{name}/`, one JSON object per line.

Every event has a `type` and a `time` (Unix seconds). The controller collects events in
memory and flushes them through `pyarrow.fs` on a thread of the journal's own (`flush_soon`), so
a store that stalls never holds the controller up: the events wait in memory and are written, in
order, once it answers. A flush writes only the events emitted since the previous one, so its
cost does not grow with the run:

- On a local disk the new lines are appended to `events.jsonl`.
- On an object store (S3, GCS), which cannot append, each flush is a new segment file
  `events/<12-digit sequence>.jsonl`, written once and never rewritten. A journal opened over
  an existing run (a resumed run, a restarted controller) continues after the last segment.

`read_events` joins `events.jsonl`, if present, and then the segments in order. A flush writes
whole lines, and a reader ignores a last line without its newline: a reader can never see
half an event, even while a local append is in progress.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any, Iterable

import pyarrow.fs as pafs

from elastic.checkpoint.storage import RunStorage

EVENT_TYPES = (
    "run_started",
    "run_finished",
    "run_failed",
    "run_resumed",
    "controller_restarted",
    "fault_injected",
    "worker_started",
    "worker_failed",
    "generation_formed",
    "formation_failed",
    "recovery",
    "rescale",
    "decision",
    "state",
    "checkpoint_saved",
    "checkpoint_skipped",
    "fenced",
    "metrics",
    "warning",
)
# Events a watcher must see as they happen, not after the heal they start: a flush follows
# them at once. The rest (metrics above all) wait for the next periodic flush.
PROMPT_EVENT_TYPES = frozenset({"worker_failed", "decision", "recovery", "state", "generation_formed", "fenced"})

# How long the journal's thread waits before writing again to a store that failed a flush.
FLUSH_RETRY_S = 1.0

# Every event is also logged (`logging.getLogger("elastic.journal.events")`): what went wrong as a
# warning, the periodic metrics at debug, the rest at info.
_LOG_LEVEL = {"worker_failed": logging.WARNING, "checkpoint_skipped": logging.WARNING, "warning": logging.WARNING,
              "run_failed": logging.ERROR, "fenced": logging.WARNING, "metrics": logging.DEBUG}
_log = logging.getLogger(__name__)

SEGMENTS = "events"
SEGMENT_DIGITS = 12
_SEGMENT_NAME = re.compile(rf"^(\d{{{SEGMENT_DIGITS}}})\.jsonl$")


def make_event(type: str, **fields: Any) -> dict[str, Any]:
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type!r}; known types: {', '.join(EVENT_TYPES)}")
    return {"type": type, "time": time.time(), **fields}


def segment_name(sequence: int) -> str:
    return f"{SEGMENTS}/{sequence:0{SEGMENT_DIGITS}d}.jsonl"


class EventJournal:
    """Collects events and writes the new ones to the run folder on each flush.

    `existing` are the events already stored for this run (`read_events(storage)`): they are
    part of `events` but are not written again.
    """

    FILE = "events.jsonl"

    def __init__(self, storage: RunStorage, existing: Iterable[dict[str, Any]] = (),
                 retry_s: float = FLUSH_RETRY_S) -> None:
        self._storage = storage
        self._events: list[dict[str, Any]] = list(existing)
        self._flushed = len(self._events)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._writer: _Appender | _SegmentWriter | None = None
        self._retry_s = retry_s
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None
        self.flush_error: str | None = None  # why the last flush failed; None once one succeeded

    def emit(self, type: str, **fields: Any) -> dict[str, Any]:
        event = make_event(type, **fields)
        with self._lock:
            self._events.append(event)
        level = _LOG_LEVEL.get(type, logging.INFO)
        if _log.isEnabledFor(level):
            _log.log(level, "%s %s", type, json.dumps(fields, default=str))
        return event

    @property
    def due(self) -> bool:
        """Whether an event emitted since the last flush must be written now (`PROMPT_EVENT_TYPES`)."""
        with self._lock:
            return any(e["type"] in PROMPT_EVENT_TYPES for e in self._events[self._flushed:])

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def events_since_start(self, attempt: str) -> list[dict[str, Any]]:
        """The events of attempt `attempt` of the run, from its `run_started` on (the journal of a
        run folder holds every attempt's)."""
        events = self.events
        starts = [i for i, e in enumerate(events) if e["type"] == "run_started" and e.get("attempt") == attempt]
        return events[starts[0]:] if starts else []

    @property
    def unwritten(self) -> int:
        """How many events are kept in memory only, not yet in the store."""
        with self._lock:
            return len(self._events) - self._flushed

    def flush_soon(self) -> None:
        """Have the journal's own thread write the new events; never waits for the store.

        A store that is away keeps them in memory (`events` still has them), and the thread
        writes them when it answers again, in order, retrying every `retry_s`."""
        with self._lock:
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_forever, daemon=True, name="elastic-journal")
                self._flusher.start()
        self._wake.set()

    def _flush_forever(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                self.flush()
            except Exception as exc:  # any storage error: the events wait in memory for the retry
                self.flush_error = f"{type(exc).__name__}: {exc}"
                time.sleep(self._retry_s)
                self._wake.set()

    def flush(self) -> None:
        """Write the events emitted since the last flush; those emitted meanwhile wait for the next."""
        # One writer at a time: two flushes must not write the same events, or in the wrong order.
        with self._write_lock:
            with self._lock:
                end = len(self._events)
                if end == self._flushed:
                    return
                data = "".join(json.dumps(e, default=str) + "\n" for e in self._events[self._flushed:end]).encode()
            if self._writer is None:
                self._writer = _open_writer(self._storage)
            self._writer.write(data)
            self._flushed = end
            self.flush_error = None


def _open_writer(storage: RunStorage) -> _Appender | _SegmentWriter:
    # A run that already has segments keeps using them, so events.jsonl stays the older part.
    sequences = _segments(storage)
    if isinstance(storage.fs, pafs.LocalFileSystem) and not sequences:
        return _Appender(storage)
    return _SegmentWriter(storage, sequences[-1][0] + 1 if sequences else 0)


class _Appender:
    """Appends to events.jsonl on a local disk."""

    def __init__(self, storage: RunStorage) -> None:
        self._storage = storage
        self._path = storage.path(EventJournal.FILE)
        self._tail_checked = False

    def write(self, data: bytes) -> None:
        if not self._tail_checked:
            self._drop_torn_tail()
            self._tail_checked = True
        try:
            with self._storage.fs.open_append_stream(self._path, compression=None) as out:
                out.write(data)
        except BaseException:
            self._tail_checked = False  # part of the lines may have landed
            raise

    def _drop_torn_tail(self) -> None:
        """Cut a last line without its newline (a crash mid-append), so appends start on a line."""
        fs = self._storage.fs
        fs.create_dir(self._storage.root, recursive=True)
        size = self._storage.size(EventJournal.FILE)
        if not size:
            return
        with fs.open_input_file(self._path) as stream:
            stream.seek(size - 1)
            if stream.read(1) == b"\n":
                return
        text = self._storage.read_text(EventJournal.FILE)
        self._storage.write_text_atomic(EventJournal.FILE, text[: text.rfind("\n") + 1])


class _SegmentWriter:
    """Writes each flush as the next segment file, on stores that cannot append."""

    def __init__(self, storage: RunStorage, sequence: int) -> None:
        self._storage = storage
        self._sequence = sequence
        storage.fs.create_dir(storage.path(SEGMENTS), recursive=True)

    def write(self, data: bytes) -> None:
        # An object appears whole when its upload completes; a failed upload is retried under
        # the same name with the same first events, so no event is stored twice.
        with self._storage.fs.open_output_stream(self._storage.path(segment_name(self._sequence))) as out:
            out.write(data)
        self._sequence += 1


def _segments(storage: RunStorage) -> list[tuple[int, str]]:
    """(sequence, relative path) of every segment file, in order."""
    selector = pafs.FileSelector(storage.path(SEGMENTS), allow_not_found=True)
    found = []
    for info in storage.fs.get_file_info(selector):
        match = _SEGMENT_NAME.match(info.base_name)
        if info.type == pafs.FileType.File and match:
            found.append((int(match.group(1)), f"{SEGMENTS}/{info.base_name}"))
    return sorted(found)


def has_journal(storage: RunStorage) -> bool:
    """Whether the run folder holds a journal: events.jsonl or at least one segment."""
    return storage.size(EventJournal.FILE) is not None or bool(_segments(storage))


def read_events(storage: RunStorage) -> list[dict[str, Any]]:
    """The events of a run, oldest first; an empty list when the run has none yet.

    A line that is not JSON raises ValueError naming its file.
    """
    files = [EventJournal.FILE, *(name for _, name in _segments(storage))]
    events = []
    for name in files:
        try:
            text = storage.read_text(name)
        except FileNotFoundError:
            continue
        # Text after the last newline is a line still being appended: not an event yet.
        for line in text[: text.rfind("\n") + 1].splitlines():
            if line.strip():
                try:
                    events.append(json.loads(line))
                except ValueError as exc:
                    raise ValueError(f"{storage.uri}/{name}: {exc}") from None
    return events


def events_of(events: Iterable[dict[str, Any]], type: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == type]
