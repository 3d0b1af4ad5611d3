"""Checkpoint snapshots: when this worker snapshots the run's state, and what it hands the writer.

At a step boundary the schedule (`CheckpointConfig`: every N steps, the last step, or every so
many seconds) may call for a checkpoint. Training waits only for the snapshot's copy to the
CPU; the `CheckpointWriter` uploads it in the background, one checkpoint at a time, and a store
that stalls holds only the writer (a newer snapshot replaces one still waiting to upload). A timed
checkpoint must be taken at the same step by every rank: each boundary all-reduce (`launch_flag`)
carries whether a rank's timer ran out, and is read at the next boundary (`read_flag`), so the
ranks agree without ever waiting on the check. `Snapshots` also holds what rank 0 adds to every
checkpoint: the train loop's files and metadata, and the directory it reported last.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint import reported
from elastic.checkpoint.checkpoint import Checkpoint, CheckpointWriter, take_snapshot
from elastic.checkpoint.host_buffers import HostBuffers
from elastic.comm.generation import collectives_landed, peer_failed
from elastic.comm.state_sync import RunState
from elastic.config import CheckpointConfig
from elastic.errors import ElasticError
from elastic.parallel.prepared import PreparedModel
from elastic.techniques.strategy import Techniques
from elastic.worker.injection import FaultInjector, die
from elastic.worker.membership import Membership, Progress

# Steps between the boundary all-reduces that agree on time-based checkpoints (only runs with
# CheckpointConfig(every_s) launch them). The step index decides, so every rank checks at the
# same boundaries; rarer checks cost less step time.
AGREEMENT_EVERY_STEPS = 8


class Snapshots:
    """This worker's checkpoint schedule, the pending timed-checkpoint flag, and the files rank 0 adds."""

    def __init__(self, config: CheckpointConfig, writer: CheckpointWriter | None, *, state: RunState,
                 progress: Progress, membership: Membership, model: Callable[[], PreparedModel],
                 techniques: Techniques, faults: FaultInjector,
                 latest_checkpoint: Callable[[], Checkpoint | None]) -> None:
        """`state` and `progress`: what a snapshot copies; `membership` and `model`: the generation and the
        part this rank writes; `latest_checkpoint` asks the controller (for the directory rank 0 reported)."""
        if config.enabled and writer is None:
            raise ElasticError("a checkpoint schedule needs a CheckpointWriter")
        self.config = config
        self._writer = writer
        self._state = state
        self._progress = progress
        self._membership = membership
        self._model = model
        self._techniques = techniques
        self._faults = faults
        self._latest_checkpoint = latest_checkpoint  # asks the controller
        self._files: dict[str, bytes] = {}
        self._metadata: dict[str, Any] = {}
        # The latest directory rank 0 reported, which rank 0 writes into every checkpoint (or what
        # reads the latest checkpoint's, on the writer's thread); None until this worker reported
        # one or, as rank 0, took a checkpoint.
        self._reported_files: dict[str, bytes] | Callable[[], dict[str, bytes]] | None = None
        self._last_checkpoint = time.monotonic()
        self._flag: tuple[Callable[[], Any], torch.Tensor] | None = None  # its wait, and where the MAX lands
        self._buffers = HostBuffers()  # reused by every snapshot of the same sizes
        self._taken: tuple[int, int] | None = None  # (generation, step) of the last snapshot taken

    def add_file(self, name: str, data: bytes) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ElasticError(f"checkpoint file name {name!r} must be a plain file name")
        self._files[name] = bytes(data)

    def set_metadata(self, **metadata: Any) -> None:
        self._metadata.update(metadata)

    def report(self, checkpoint: Any, rank: int) -> None:
        """Keep the directory `checkpoint` names for every checkpoint from now on (rank 0's)."""
        self._reported_files = reported.files_to_store(checkpoint, rank, self.config)

    def _latest_reported(self) -> dict[str, bytes]:
        """The directory the latest checkpoint carries, asked for at write time: the one that was
        latest when the snapshot was taken may be gone since (retention, once a newer one, still
        uploading then, completed)."""
        latest = self._latest_checkpoint()
        return latest.read_reported() if latest is not None else {}

    def after_step(self, max_steps: int | None) -> None:
        """At the boundary after a committed step: checkpoint where the schedule says, or start the timed check."""
        step, every = self._progress.step, self.config.every_steps
        if every and step % every == 0:
            self.take()
        timed = self.config.every_s is not None
        if timed and step != max_steps and step % AGREEMENT_EVERY_STEPS == 0:
            self._launch_flag()

    def final(self) -> None:
        """After the run's last step: checkpoint it, unless this generation's schedule just did (a
        generation that formed after its members checkpointed the step, around a newcomer, takes it
        again: every member's shard, which each decides alike)."""
        if self.config.enabled and self._taken != (self._membership.generation, self._progress.step):
            self.take()

    def _launch_flag(self) -> None:
        """Start the all-reduce that makes every rank agree whether a timed checkpoint is due.

        Each rank contributes whether its checkpoint timer ran out; the MAX is read at the next
        boundary, so all ranks snapshot the same step while training never waits for the check.
        """
        timer_due = time.monotonic() - self._last_checkpoint >= self.config.every_s
        # On the device the generation's collectives run on (NCCL's: the GPU), filled there: a
        # tensor made from a host list would be a blocking copy.
        device = self._membership.device
        flag = torch.full((1,), int(timer_due), dtype=torch.int64, device=device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if device.type != "cuda":
            self._flag = (work.wait, flag)
            return
        # NCCL's wait only orders the stream; the MAX comes to pinned host memory behind it, and the
        # next boundary reads it once it landed (`read_flag`), without a blocking copy.
        work.wait()
        landed = torch.empty(1, dtype=torch.int64, pin_memory=True).copy_(flag, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._flag = (copied.synchronize, landed)

    def drop_flag(self) -> None:
        """Forget the pending check: a heal leaves its group, which nothing may keep alive."""
        self._flag = None

    def read_flag(self, heal: Callable[[], None]) -> bool:
        """Whether the ranks agreed on a checkpoint at this boundary; `heal` if a peer died in the check."""
        if self._flag is None:
            return False
        wait, flag = self._flag
        self._flag = None
        try:
            # On NCCL: whether the all-reduce completed (a collective: every rank reads the flag at this
            # boundary). The host waits for the step's kernels once every AGREEMENT_EVERY_STEPS steps.
            collectives_landed()
            wait()
        except Exception as exc:
            if not peer_failed(exc):
                raise
            heal()
            return False
        return bool(flag.item())

    def take(self) -> None:
        """Snapshot to CPU (training waits only for this copy; from a GPU, not even for it: the copies
        are queued on the stream, `take_snapshot`) and write the shard in the background. A
        collective where a technique keeps per-rank state (it is averaged first): raises if a peer died."""
        started = time.perf_counter()
        self._faults.at("checkpoint", self._membership.rank, self._progress.step)
        kept = self._techniques.checkpoint_state(self._state, self._progress.to_dict())
        if kept is None:
            return  # local SGD has not synced since the last checkpoint: nothing new to keep
        self._taken = (self._membership.generation, self._progress.step)
        snapshot = take_snapshot(*kept, pool=self._buffers, optimizer_shard=self._techniques.optimizer_shard())
        membership = self._membership
        rank = membership.rank
        if rank == 0 and self._reported_files is None:
            # A new rank 0 (after a heal or a restart) carries the directory the old one reported,
            # read from the store by the writer's thread: once, but again after a read that failed.
            self._reported_files = functools.cache(self._latest_reported)
        crash = self._faults.crash_checkpoint(rank, self._progress.step)
        # Never waits for the store: a snapshot taken while the last one uploads waits in the
        # writer, replacing any older one still waiting (`CheckpointWriter`).
        self._writer.submit(snapshot, rank, membership.world_size, time.perf_counter() - started,
                            self._files, self._metadata, crash_midway=die if crash else None,
                            reported_files=self._reported_files,
                            generation=membership.generation,
                            part=self._model().checkpoint_part(membership.replica_rank, membership.num_replicas))
        self._last_checkpoint = time.monotonic()

    def wait_for_writer(self) -> None:
        """Wait for the uploads still under way (at the end of the run)."""
        if self._writer is not None:
            self._writer.wait()
