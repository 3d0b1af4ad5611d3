"""Completing checkpoints: each rank reports the shard it wrote; the last report of a step
writes the manifest (which makes the checkpoint exist), and retention (`retain`) follows once
the controller takes it for the latest.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from elastic.checkpoint.checkpoint import (
    MANIFEST,
    Checkpoint,
    checkpoint_steps,
    checkpoint_storage,
    step_dir,
    steps_to_delete,
    write_manifest,
)
from elastic.checkpoint.storage import RunStorage, StorageError


class ShardCollector:
    """The shards reported for each checkpoint, keyed by the generation that took it: after a
    restart replays a step, a snapshot of that step by another generation is another
    checkpoint, never completed by the shards the old one left behind."""

    def __init__(self, storage: RunStorage, keep_last: int, attempt: str = "") -> None:
        self.storage = storage
        self.keep_last = keep_last
        self.attempt = attempt  # named in each manifest: a restarted controller resumes from its own
        self._shards: dict[tuple[int, int, int], dict[int, dict[str, Any]]] = {}

    def add(self, report: dict[str, Any]) -> tuple[Checkpoint, dict[str, Any]] | None:
        """Record one rank's written shard; with the last one, the completed checkpoint and
        the fields of its `checkpoint_saved` event."""
        step, world_size = report["step"], report["world_size"]
        key = (step, world_size, report.get("generation", 0))
        by_rank = self._shards.setdefault(key, {})
        by_rank[report["rank"]] = report
        if len(by_rank) < world_size:
            return None
        shards = [by_rank[rank] for rank in range(world_size)]
        files = [f for r in shards for f in r["files"]]
        metadata = next(r["metadata"] for r in shards if r["rank"] == 0)
        try:
            owner = self.storage.owner()
            if self.attempt and owner != self.attempt:
                raise StorageError(f"another fit() of the run took its folder (attempt {str(owner)[:8]}, this one is "
                                   f"{self.attempt[:8]}): give one of them another RunConfig(name=...)")
            manifest = write_manifest(self.storage, shards[0]["progress"], world_size, files, metadata,
                                      self.attempt)
        finally:
            del self._shards[key]  # written or failed, no report is to come for it
        checkpoint = Checkpoint(checkpoint_storage(self.storage, step), manifest)
        return checkpoint, {"step": step, "bytes": sum(f["size"] for f in files),
                            "stall_s": max(r["stall_s"] for r in shards),
                            "upload_s": max(r["upload_s"] for r in shards), "path": checkpoint.path}

    def incomplete(self) -> dict[int, str]:
        """The checkpoints some ranks reported and others never did, by step: why each is not saved."""
        return {step: f"{len(by_rank)} of its {world_size} shards were written"
                for (step, world_size, _), by_rank in self._shards.items()}

    def retain(self, latest: int, pinned: Collection[int] = ()) -> None:
        """Delete the checkpoints past `keep_last` older than the run's `latest` step, but for the
        steps `pinned` (a restart in flight restores one)."""
        steps = checkpoint_steps(self.storage)
        complete = [s for s in steps if s <= latest and self.storage.size(f"{step_dir(s)}/{MANIFEST}") is not None]
        for step in steps_to_delete(steps, complete, self.keep_last, latest, pinned):
            self.storage.delete_dir(step_dir(step))
