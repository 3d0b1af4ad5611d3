"""Reading a run folder after the fact: its state, size, step, events and checkpoints.

Everything here reads `{storage_path}/{name}/` through `RunStorage` (local, `s3://`, `gs://`)
and needs neither Ray nor the run to be alive, so it works on a finished run, a failed one,
or one still training elsewhere:

    run = open_run("./runs", "demo")
    print(run_status(run.events).state)
    complete, damaged = list_checkpoints(run.storage)

The journal holds every `fit()` of a run name (each an "attempt", starting with its own
`run_started`); the status describes the latest attempt.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from elastic.checkpoint.checkpoint import CHECKPOINTS, CheckpointError, checkpoint_steps, checkpoint_storage, verify
from elastic.checkpoint.storage import RunStorage, StorageError
from elastic.errors import ElasticError
from elastic.journal.events import SEGMENTS, EventJournal, has_journal, read_events

RECENT_EVENTS = 5
# Metrics are journaled every 2 s and the journal is flushed every tick while a run is alive,
# so a non-final run that has been silent this long has probably lost its driver or cluster.
STALE_AFTER_S = 60.0
VALUE_CHARS = 60
NODE_ID_CHARS = 12


class RunNotFoundError(ElasticError):
    """The run folder or its journal does not exist, or the journal cannot be read."""


@dataclass(frozen=True)
class Run:
    """A run folder and its journal, oldest event first."""

    name: str
    storage: RunStorage
    events: list[dict[str, Any]]


@dataclass(frozen=True)
class RunStatus:
    """What the journal says about the latest attempt of a run."""

    state: str
    reason: str
    step: int
    max_steps: int | None
    world_size: int
    generation: int | None
    samples_per_s: float | None
    loss: float | None
    goodput: float | None
    wall_s: float | None
    started: float
    last_event_time: float
    attempts: int
    resumed_from_step: int | None
    recent: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint whose manifest and every file verified."""

    step: int
    world_size: int
    bytes: int
    created: float | None
    path: str


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A checkpoint folder that is not a usable checkpoint, and why."""

    step: int
    reason: str


def open_run(storage_path: str, name: str) -> Run:
    """The run `name` under `storage_path`; RunNotFoundError says what is missing instead."""
    storage = RunStorage(storage_path, name)
    try:
        events = read_events(storage)
    except ValueError as exc:
        raise RunNotFoundError(f"the journal of {storage.uri} has a line that is not JSON ({exc}); "
                               "the journal is damaged") from None
    if not has_journal(storage):
        parent = storage.root.rpartition("/")[0] or "/"
        if storage.fs.get_file_info(parent).type == pafs.FileType.NotFound:
            raise RunNotFoundError(f"storage path {storage_path!r} does not exist; pass --storage-path, "
                                   "the RunConfig.storage_path the run was started with")
        runs = _runs_under(storage.fs, parent)
        known = f"runs there: {', '.join(runs)}" if runs else "there are no runs there"
        raise RunNotFoundError(f"no run {name!r} under {storage_path!r} ({storage.uri} has no journal: "
                               f"neither {EventJournal.FILE} nor {SEGMENTS}/); {known}")
    return Run(name, storage, events)


def _runs_under(fs: pafs.FileSystem, parent: str) -> list[str]:
    folders = fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
    return sorted(f.base_name for f in folders
                  if f.type == pafs.FileType.Directory and _is_run(fs, parent, f.base_name))


def _is_run(fs: pafs.FileSystem, parent: str, name: str) -> bool:
    try:
        storage = RunStorage(parent, name, fs)
    except StorageError:  # a folder name no run can have
        return False
    return has_journal(storage)


def latest_attempt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the newest `fit()`: from the first `run_started` of its attempt on.

    A controller that Ray restarted emits `run_started` again with the same attempt, so the
    attempt starts at its first one, and its restarts stay inside it.
    """
    starts = [i for i, e in enumerate(events) if e["type"] == "run_started"]
    if not starts:
        return list(events)
    attempt = events[starts[-1]].get("attempt")
    first = next(i for i in starts if events[i].get("attempt") == attempt)
    return events[first:]


def count_attempts(events: list[dict[str, Any]]) -> int:
    return len({e.get("attempt") for e in events if e["type"] == "run_started"})


def run_status(events: list[dict[str, Any]], now: float | None = None) -> RunStatus:
    """The latest attempt's state, step, world size, throughput, loss and goodput."""
    if not events:
        raise RunNotFoundError("the run's journal is empty: the run has not started yet")
    attempt = latest_attempt(events)
    state, reason = "STARTING", ""
    step, max_steps, world_size, generation = 0, None, 0, None
    samples_per_s = loss = goodput = wall_s = None
    resumed_from = None
    for event in attempt:
        kind = event["type"]
        if kind == "run_started":
            max_steps = event.get("data", {}).get("max_steps", max_steps)
        elif kind == "run_resumed":
            resumed_from = step = event["step"]
        elif kind == "state":
            state, reason = event["state"], event.get("reason", "")
        elif kind == "generation_formed":
            world_size, generation, step = event["world_size"], event["generation"], event.get("step", step)
        elif kind == "metrics":
            step, samples_per_s = event["step"], event.get("samples_per_s")
            reported = event.get("metrics", {}).get("loss")
            loss = reported if isinstance(reported, (int, float)) else loss
        elif kind == "checkpoint_saved":
            # Shards are written in the background, so a checkpoint can be announced after later steps.
            step = max(step, event["step"])
        elif kind == "run_finished":
            state, step, goodput, wall_s = "FINISHED", event["step"], event.get("goodput"), event.get("wall_s")
        elif kind == "run_failed":
            state, reason = "FAILED", event.get("error", reason)
    latest = attempt[-1]["time"]
    silent_s = (time.time() if now is None else now) - latest
    if state not in ("FINISHED", "FAILED") and silent_s > STALE_AFTER_S:
        stale = f"no event for {_duration(silent_s)}: the run's driver or cluster may have stopped"
        reason = f"{reason}; {stale}" if reason else stale
    recent = [e for e in attempt if e["type"] != "metrics"][-RECENT_EVENTS:]
    return RunStatus(state, reason, step, max_steps, world_size, generation, samples_per_s, loss, goodput, wall_s,
                     attempt[0]["time"], latest, count_attempts(events), resumed_from, recent)


def list_checkpoints(storage: RunStorage) -> tuple[list[CheckpointInfo], list[DamagedCheckpoint]]:
    """Every checkpoint folder of the run, verified: the complete ones, and the others with why."""
    complete, damaged = [], []
    for step in checkpoint_steps(storage):
        try:
            checkpoint = verify(checkpoint_storage(storage, step))
        except CheckpointError as exc:
            damaged.append(DamagedCheckpoint(step, str(exc)))
            continue
        manifest = checkpoint.manifest
        complete.append(CheckpointInfo(step, checkpoint.world_size, sum(f["size"] for f in manifest["files"]),
                                       manifest.get("created"), checkpoint.path))
    return complete, damaged


def checkpoints_uri(storage: RunStorage) -> str:
    return f"{storage.uri}/{CHECKPOINTS}"


# --- formatting for the command line -----------------------------------------------------
def format_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def format_event(event: dict[str, Any], start: float) -> str:
    """One line: local time, seconds since `start`, type, then the other fields as key=value."""
    fields = " ".join(f"{k}={_short(_readable(k, v))}" for k, v in event.items() if k not in ("type", "time"))
    return f"{format_time(event['time'])}  {event['time'] - start:+8.1f}s  {event['type']:<18} {fields}".rstrip()


def _readable(key: str, value: Any) -> Any:
    """Members as their worker ids and Ray node ids cut short: the full ones are in --json."""
    if key == "members" and isinstance(value, list) and all(isinstance(m, dict) and "worker_id" in m for m in value):
        return [m["worker_id"] for m in value]
    if key == "node" and isinstance(value, str) and len(value) > NODE_ID_CHARS:
        return value[:NODE_ID_CHARS] + "…"
    return value


def _short(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, str) and " " not in value and value:
        text = value
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 1] + "…"


def format_bytes(n: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    size, unit = float(n), 0
    while size >= 1024 and unit < len(units) - 1:
        size, unit = size / 1024, unit + 1
    return f"{n} B" if unit == 0 else f"{size:.1f} {units[unit]}"


def format_age(t: float | None, now: float | None = None) -> str:
    return "unknown" if t is None else f"{_duration((time.time() if now is None else now) - t)} ago"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
