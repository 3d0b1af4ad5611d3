"""The event journal: `{storage_path}/{name}/events.jsonl`, one JSON object per line.

Every event has a `type` and a `time` (Unix seconds). The controller appends events in
memory and flushes them through `pyarrow.fs`; a flush writes the whole journal to a temporary
file and moves it into place, so a reader never sees a half-written line, on a local disk or
on an object store.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterable

from elastic.storage import RunStorage

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
    "recovery",
    "rescale",
    "decision",
    "state",
    "checkpoint_saved",
    "checkpoint_skipped",
    "metrics",
)


def make_event(type: str, **fields: Any) -> dict[str, Any]:
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type!r}; known types: {', '.join(EVENT_TYPES)}")
    return {"type": type, "time": time.time(), **fields}


class EventJournal:
    """Collects events and writes them to the run folder."""

    FILE = "events.jsonl"

    def __init__(self, storage: RunStorage, existing: Iterable[dict[str, Any]] = ()) -> None:
        self._storage = storage
        self._events: list[dict[str, Any]] = list(existing)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._dirty = False

    def emit(self, type: str, **fields: Any) -> dict[str, Any]:
        event = make_event(type, **fields)
        with self._lock:
            self._events.append(event)
            self._dirty = True
        return event

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def flush(self) -> None:
        # One writer at a time, so an older snapshot never lands after a newer one.
        with self._write_lock:
            with self._lock:
                if not self._dirty:
                    return
                text = "".join(json.dumps(e, default=str) + "\n" for e in self._events)
                self._dirty = False
            self._storage.write_text_atomic(self.FILE, text)


def read_events(storage: RunStorage) -> list[dict[str, Any]]:
    """The events of a run, oldest first; an empty list when the run has none yet."""
    try:
        text = storage.read_text(EventJournal.FILE)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def events_of(events: Iterable[dict[str, Any]], type: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == type]
