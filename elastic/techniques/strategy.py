"""The run's `Strategy` on one worker: what each technique does at each point of a run.

`TrainContext` calls in at the points that matter, and this module decides what each
technique needs there; the techniques themselves live in their own modules (precision,
compression, powersgd, zero, local_sgd). The points:

- preparing the model and the optimizer: which objects exist and how their state is synced;
- a step's commit or failure: PowerSGD keeps a step's changes only if it commits;
- a formation, before and after the replicated sync: local SGD rolls back to its last sync
  (and EASGD's ranks restart from the center), per-rank state is averaged over the ranks that
  held it, ZeRO's shards are resharded;
- a checkpoint: which state is written (local SGD: its last sync's; EASGD: the center as the
  model; stale synchrony: its complete state of S steps back), with per-rank state averaged so
  that every rank's slice fits the others';
- a step boundary and a planned switch: stale synchrony keeps its complete state S steps
  behind, and waits for the reductions in flight before a switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from elastic.checkpoint.checkpoint import Checkpoint
from elastic.comm.state_sync import average_over_holders, state_of, take_awaited
from elastic.config import Strategy
from elastic.techniques.compression import GradientCompression
from elastic.techniques.local_sgd import Backup, OuterSync
from elastic.techniques.overlap import OptimizerOverlap
from elastic.techniques.powersgd import PowerSGD
from elastic.techniques.precision import Precision
from elastic.techniques.shard_plan import ShardPosition
from elastic.techniques.stale import StaleSync
from elastic.techniques.zero import ShardedOptimizer


@dataclass
class Held:
    """What a rank held when a generation formed, taken before the replicated sync."""

    progress: dict[str, Any]  # the progress to sync from: under local SGD, its last sync's
    rolled_back: int  # committed steps undone to get there
    per_rank: dict[str, Any]  # each per-rank state as it was
    position: ShardPosition | None  # ZeRO: the shards it holds


class Techniques:
    """One worker's techniques, for every generation of the run."""

    def __init__(self, strategy: Strategy, device: torch.device, max_steps: int, seed: int) -> None:
        self.strategy = strategy
        self.device = device
        self.precision = Precision(strategy.precision, device)
        casting = strategy.compression if strategy.compression in ("fp16", "bf16") else "none"
        # What DDP's gradient hook does to each bucket (PowerSGD once the model is prepared).
        self.codec: GradientCompression | PowerSGD = GradientCompression(casting)
        self.outer: OuterSync | None = None  # local SGD / DiLoCo / EASGD
        self.stale: StaleSync | None = None  # stale-synchronous all-reduce
        self.zero: ShardedOptimizer | None = None  # ZeRO-1
        # The optimizer stepped bucket by bucket as DDP's all-reduces land.
        self.overlap = OptimizerOverlap() if strategy.overlap_optimizer else None
        self.sharded: Any = None  # ZeRO-2/3: a FullyShardedModel
        self.backup = Backup()  # local SGD's state at its last sync
        self._max_steps = max_steps
        self._seed = seed
        self._optimizer: torch.optim.Optimizer | None = None
        self._gradient_bytes = 0  # what one step's gradient sync hands to DDP's all-reduce
        self._last_checkpointed = -1

    # --- preparing ----------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, objects: dict[str, Any]) -> None:
        """Create what works on `model`, registering its replicated state in `objects`."""
        self._gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if self.strategy.zero >= 2:
            # FSDP2 (torch >= 2.6) is imported only by the runs that use it.
            from elastic.techniques.fsdp import FullyShardedModel, ShardedBuffers

            self.sharded = FullyShardedModel(model, self.strategy.zero, self.strategy.zero_replicas)
            objects["model"] = ShardedBuffers(self.sharded)  # the parameters are sharded, not synced whole
        sync = self.strategy.sync_options
        if sync["kind"] == "stale":
            self.stale = objects["stale"] = StaleSync(sync["bound"], model, self._max_steps)
        elif sync["kind"] != "ddp":
            self.outer = objects["outer_sync"] = OuterSync(sync, model, self._max_steps)
        options = self.strategy.compression_options
        if options["kind"] == "powersgd":
            self.codec = objects["powersgd"] = PowerSGD(list(model.parameters()), options["rank"],
                                                        options["start_iter"], seed=self._seed)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, objects: dict[str, Any]) -> torch.optim.Optimizer:
        """The optimizer the train loop steps: under ZeRO a `ShardedOptimizer` around `optimizer`,
        whose state is sharded rather than registered."""
        if self.sharded is not None:
            optimizer = self.sharded.adopt(optimizer)
        elif self.strategy.zero:
            optimizer = self.zero = ShardedOptimizer(optimizer, replicas=self.strategy.zero_replicas)
        else:
            take_awaited(objects, "optimizer", optimizer)
        if self.precision.scaler is not None:
            objects["grad_scaler"] = self.precision.scaler
            self.precision.wrap_step(optimizer)
        if self.overlap is not None:
            self.overlap.adopt(optimizer)
        self._optimizer = optimizer
        return optimizer

    def hook_optimizer(self, optimizer: torch.optim.Optimizer, where: Callable[[], tuple[int, int]],
                       launch: Callable[[torch.Tensor], torch.futures.Future]) -> None:
        """Stale synchrony's hooks on the prepared optimizer's steps (`StaleSync.adopt`)."""
        if self.stale is not None:
            self.stale.adopt(optimizer, where, launch)

    @property
    def replaces_ddp(self) -> bool:
        """Local SGD syncs parameters itself, stale synchrony all-reduces gradients itself, ZeRO-2/3
        reduce-scatters them in FSDP2: no DDP."""
        return self.outer is not None or self.stale is not None or self.sharded is not None

    @property
    def acts_between_steps(self) -> bool:
        """Local SGD syncs and stale synchrony keeps its state at step boundaries; the rest do nothing there."""
        return self.outer is not None or self.stale is not None

    @property
    def hooks_gradients(self) -> bool:
        """DDP's gradient all-reduce must go through `codec`, and then step the optimizer where it overlaps."""
        return self.strategy.compression != "none" or self.overlap is not None

    @property
    def reduces_within_nodes(self) -> bool:
        """DDP's gradient all-reduce may sum within each node first (`Strategy(all_reduce)`); local SGD
        and ZeRO-2/3 have no DDP."""
        strategy = self.strategy
        return strategy.all_reduce == "hierarchical" and strategy.sync_options["kind"] == "ddp" and strategy.zero < 2

    # --- a step -------------------------------------------------------------------------
    def committed(self) -> None:
        if isinstance(self.codec, PowerSGD):
            self.codec.commit()
        if self.overlap is not None:
            self.overlap.committed()

    def failed(self) -> None:
        """The step in flight failed and will be redone."""
        if isinstance(self.codec, PowerSGD):
            self.codec.discard()
        if self.overlap is not None:
            self.overlap.roll_back()

    def count_unhooked_sync(self) -> None:
        """DDP synced a step's gradients without the hook: it sends each gradient once."""
        if not self.replaces_ddp:
            self.codec.bytes_sent += self._gradient_bytes

    def sync_due(self, step: int) -> bool:
        return self.outer is not None and self.outer.due(step)

    def outer_sync(self, objects: dict[str, Any], progress: dict[str, Any]) -> None:
        """Local SGD's sync after committed step `progress["step"]`; raises if a peer died in it."""
        self.outer.sync(progress["step"])
        self.backup.take(objects, progress)

    def at_boundary(self, objects: dict[str, Any], progress: Any) -> None:
        """A step boundary (`progress`: the run's `Progress`): stale synchrony keeps what the step left."""
        if self.stale is not None:
            self.stale.at_boundary(objects, progress.to_dict())

    def drain(self) -> None:
        """Before a planned switch: stale synchrony waits for its reductions in flight; raises if a peer died."""
        if self.stale is not None:
            self.stale.drain()

    def communication(self) -> dict[str, int]:
        outer, stale = self.outer, self.stale
        return {"sync_bytes": self.codec.bytes_sent + (outer.bytes_sent if outer else 0)
                + (stale.bytes_sent if stale else 0),
                "outer_syncs": outer.syncs if outer else 0}

    # --- a formation ---------------------------------------------------------------------
    def before_sync(self, objects: dict[str, Any], progress: dict[str, Any], holds_state: bool) -> Held:
        """Take what this rank holds; under local SGD first go back to the last sync, the only
        point where the state is the same on every rank (the interval is then replayed)."""
        self.failed()  # a step that failed in the old generation is redone in the new one
        rolled_back = 0
        if holds_state and self.outer is not None and self.backup.step not in (None, progress["step"]):
            restored = self.backup.restore(objects)
            rolled_back, progress = progress["step"] - restored["step"], restored
        if holds_state and self.stale is not None:
            progress, rolled_back = self.stale.roll_back(objects, progress)
        sharded = self.zero if self.zero is not None else self.sharded
        return Held(progress, rolled_back, {name: get() for name, (get, _) in self._per_rank().items()},
                    sharded.position if sharded is not None and holds_state else None)

    def after_sync(self, held: Held, objects: dict[str, Any], progress: dict[str, Any], holds_state: bool,
                   resume_from: Checkpoint | None) -> None:
        """Average per-rank state over its holders and reshard ZeRO's at the synced step
        (`progress`), and start EASGD's ranks from the center; collectives every rank of the
        generation calls."""
        same_step = holds_state and held.progress["step"] == progress["step"]
        for name, (get, put) in self._per_rank().items():
            put(average_over_holders(get(), held.per_rank[name] if same_step else None, self.device))
        if self.zero is not None:
            self.zero.reshard(held.position, steps=progress["step"], restoring=resume_from is not None)
            if resume_from is not None:
                self.zero.load_sharded(resume_from.load_optimizer_shards(self.zero.wants_piece))
        if self.sharded is not None:
            pieces = resume_from.load_optimizer_shards(self.sharded.wants_piece) if resume_from is not None else []
            if pieces:
                self.sharded.check_pieces(pieces)
            self.sharded.form(held.position, steps=progress["step"], pieces=pieces)
        if self.outer is not None:
            self.outer.start_from_center()
            self.backup.take(objects, progress)
        if self.stale is not None:
            self.stale.rebase(objects, progress)

    def _per_rank(self) -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
        """Each state a rank keeps for itself, as (get, put)."""
        states: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        optimizer = self._optimizer
        if self.outer is not None and optimizer is not None:
            states["optimizer"] = (lambda: optimizer.state_dict()["state"],
                                   lambda state: optimizer.load_state_dict({**optimizer.state_dict(), "state": state}))
        if isinstance(self.codec, PowerSGD):
            states["powersgd"] = (self.codec.local_state, self.codec.load_local_state)
        return states

    # --- a checkpoint --------------------------------------------------------------------
    def checkpoint_state(self, objects: dict[str, Any], progress: dict[str, Any]
                         ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(states, progress) to checkpoint now, or None if nothing new is to be kept.

        A collective: every rank checkpoints at the same step, and each writes a slice of the
        state, so the parts that differ between ranks are averaged first.
        """
        if self.outer is not None:
            states, progress = self.backup.states()  # a run resumes at a sync
            if progress["step"] == self._last_checkpointed:
                return None
            states["model"] = self.outer.model_to_checkpoint(states["model"], states["outer_sync"])
        elif self.stale is not None:
            states, progress = self.stale.committed_state(objects, progress)  # a run resumes complete
            if progress["step"] == self._last_checkpointed:
                return None
        else:
            states = {name: state_of(obj) for name, obj in objects.items()}
        for name, key in self._per_rank_keys():
            states[name] = {**states[name], key: average_over_holders(states[name][key], states[name][key],
                                                                      self.device)}
        self._last_checkpointed = progress["step"]
        return states, progress

    def optimizer_shard(self) -> dict[str, Any] | None:
        """A copy of this rank's part of ZeRO's sharded state, for the checkpoint's writer."""
        sharded = self.zero if self.zero is not None else self.sharded
        return _copied(sharded.sharded_state_dict()) if sharded is not None else None

    def _per_rank_keys(self) -> list[tuple[str, str]]:
        """(registered object, key of its state dict) of each state that differs between ranks."""
        keys = [("optimizer", "state")] if self.outer is not None and self._optimizer is not None else []
        return keys + ([("powersgd", "error")] if isinstance(self.codec, PowerSGD) else [])


def _copied(value: Any) -> Any:
    """`value` with every tensor cloned to CPU: a checkpoint is written while training goes on."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value
