"""The run's `Strategy` on one worker: its techniques, built once, called at each point of a run.

Each technique is a `Technique` (`elastic.techniques.technique`) in its own module; `TECHNIQUES`
lists them in the order their hooks run, and `Techniques` calls the ones the Strategy turns on
at the points `TrainContext` calls in at: preparing the model and the optimizer, DDP's gradient
sync, a step's commit or failure, a step boundary and a planned switch, a formation (before and
after the replicated sync, where per-rank state is averaged over the ranks that held it), and a
checkpoint (which state is written, with per-rank state averaged so that every rank's slice fits
the others'). Adding a technique: its module, its line in `TECHNIQUES`, and its knob and refusals
beside the `Strategy` (`elastic.config.COMBINATIONS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic.checkpoint.checkpoint import Checkpoint
from elastic.comm.generation import collectives_landed
from elastic.comm.state_sync import RunState, average_over_holders
from elastic.config import Strategy
from elastic.techniques.compression import GradientCompression
from elastic.techniques.local_sgd import PeriodicSync
from elastic.techniques.overlap import OptimizerOverlap
from elastic.techniques.powersgd import PowerSGDCompression
from elastic.techniques.precision import Precision
from elastic.techniques.shard_plan import ShardPosition
from elastic.techniques.sharding import ZeRO
from elastic.techniques.stale import StaleSynchrony
from elastic.techniques.technique import Codec, RankState, Run, Technique

# Every technique a Strategy can turn on, in the order their hooks run at each point: ZeRO shards the
# optimizer before precision wraps its step, and the overlapped optimizer adopts it last.
TECHNIQUES: tuple[type[Technique], ...] = (
    ZeRO,
    StaleSynchrony,
    PeriodicSync,
    GradientCompression,
    PowerSGDCompression,
    Precision,
    OptimizerOverlap,
)


@dataclass
class Held:
    """What a rank held when a generation formed, taken before the replicated sync."""

    progress: dict[str, Any]  # the progress to sync from: under local SGD, its last sync's
    rolled_back: int  # committed steps undone to get there
    per_rank: dict[str, Any]  # each per-rank state as it was
    position: ShardPosition | None  # ZeRO: the shards it holds


class Techniques:
    """One worker's techniques, for every generation of the run."""

    def __init__(self, strategy: Strategy, device: torch.device, max_steps: int | None, seed: int) -> None:
        self.strategy = strategy
        self.device = device
        run = Run(device, max_steps, seed)
        self._all = [technique for kind in TECHNIQUES if (technique := kind.build(strategy, run)) is not None]
        # Every run has one of each: the forward runs under its precision, DDP's buckets go through its codec.
        self.precision = next(t for t in self._all if isinstance(t, Precision))
        self._codec = next(t for t in self._all if isinstance(t, Codec))
        # Known from the Strategy alone, and read in the hot paths.
        self.replaces_ddp = any(t.replaces_ddp for t in self._all)
        self.hooks_gradients = any(t.hooks_gradients for t in self._all)
        self.keeps_torch_buckets = any(t.keeps_torch_buckets for t in self._all)
        self.steps_on_bucket_views = any(t.steps_on_bucket_views for t in self._all)
        self.lands_in_step = any(t.lands_in_step for t in self._all)
        self.lands_own_sums = any(t.lands_own_sums for t in self._all)
        # The hooks called at every step and bucket go only to the techniques that act there: a
        # step of a run with none of them calls none (the no-op base hooks cost a call each).
        self._after_reduce = _acting(self._all, Technique.after_reduce)
        self._committed = _acting(self._all, Technique.committed)
        self._failed = _acting(self._all, Technique.failed)
        self._at_boundary = _acting(self._all, Technique.at_boundary)
        self._set_gradient_sync = _acting(self._all, Technique.set_gradient_sync)
        self._optimizer: torch.optim.Optimizer | None = None
        self._gradient_bytes = 0  # what one step's gradient sync hands to DDP's all-reduce
        self._last_checkpointed = -1

    # --- preparing ----------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, state: RunState) -> None:
        """Create what works on `model`, setting its replicated state on `state`."""
        self._gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        for technique in self._all:
            technique.prepare_model(model, state)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, state: RunState) -> torch.optim.Optimizer:
        """The optimizer the train loop steps: under ZeRO one around `optimizer`, whose state is sharded
        rather than registered."""
        if not any(t.shards_optimizer for t in self._all):
            state.adopt_optimizer(optimizer)
        for technique in self._all:
            optimizer = technique.prepare_optimizer(optimizer, state)
        self._optimizer = optimizer
        return optimizer

    def hook_optimizer(self, optimizer: torch.optim.Optimizer, where: Callable[[], tuple[int, int]],
                       launch: Callable[[torch.Tensor], torch.futures.Future]) -> None:
        """The techniques' hooks on the prepared optimizer's steps (stale synchrony's)."""
        for technique in self._all:
            technique.hook_optimizer(optimizer, where, launch)

    @property
    def acts_between_steps(self) -> bool:
        """Local SGD syncs and stale synchrony keeps its state at step boundaries, once the model is prepared."""
        return any(t.acts_between_steps for t in self._all)

    @property
    def reduces_within_nodes(self) -> bool:
        """DDP's gradient all-reduce may sum within each node first (`Strategy(all_reduce)`) where DDP runs."""
        return self.strategy.all_reduce == "hierarchical" and not self.replaces_ddp

    # --- DDP's gradient sync and a step ----------------------------------------------------
    def all_reduce(self, bucket: dist.GradBucket,
                   reduce: Callable[[torch.Tensor], torch.futures.Future]) -> torch.futures.Future:
        """Average a DDP bucket through the run's codec (`reduce`: a summing all-reduce)."""
        return self._codec.all_reduce(bucket, reduce)

    def after_reduce(self, future: torch.futures.Future, bucket: dist.GradBucket) -> torch.futures.Future:
        """What the bucket does once reduced: the overlapped optimizer steps its parameters."""
        for technique in self._after_reduce:
            future = technique.after_reduce(future, bucket)
        return future

    def committed(self) -> None:
        for technique in self._committed:
            technique.committed()

    def failed(self) -> None:
        """The step in flight failed and will be redone."""
        for technique in self._failed:
            technique.failed()

    def sync_due(self, step: int) -> bool:
        return any(t.sync_due(step) for t in self._all)

    def outer_sync(self, state: RunState, progress: dict[str, Any]) -> None:
        """The periodic syncs due after committed step `progress["step"]`; raises if a peer died in one."""
        for technique in self._all:
            if technique.sync_due(progress["step"]):
                technique.sync(state, progress)

    def at_boundary(self, state: RunState, progress: Any) -> None:
        """A step boundary (`progress`: the run's `Progress`)."""
        for technique in self._at_boundary:
            technique.at_boundary(state, progress)

    def drain(self) -> None:
        """Before a planned switch: wait for what is in flight; raises if a peer died (on NCCL, where a
        wait only orders the streams, once the collectives did not land)."""
        for technique in self._all:
            technique.drain()
        collectives_landed()

    def communication(self, unhooked_syncs: int) -> dict[str, int]:
        """What the run's syncs sent; `unhooked_syncs`: the steps whose gradients DDP all-reduced without
        the run's hook (each sends every gradient once)."""
        unhooked_bytes = 0 if self.replaces_ddp else unhooked_syncs * self._gradient_bytes
        return {"sync_bytes": unhooked_bytes + sum(t.bytes_sent for t in self._all),
                "outer_syncs": sum(t.syncs for t in self._all)}

    # --- a formation ---------------------------------------------------------------------
    def before_sync(self, state: RunState, progress: dict[str, Any], holds_state: bool) -> Held:
        """Take what this rank holds, after going back to a state every holder shares (local SGD: its
        last sync; stale synchrony: its complete state)."""
        self.failed()  # a step that failed in the old generation is redone in the new one
        rolled_back = 0
        if holds_state:
            for technique in self._all:
                progress, undone = technique.rewind(state, progress)
                rolled_back += undone
        position = next((p for t in self._all if (p := t.position()) is not None), None) if holds_state else None
        return Held(progress, rolled_back, {own.name: own.get() for own in self._rank_states()}, position)

    def after_sync(self, held: Held, state: RunState, progress: dict[str, Any], holds_state: bool,
                   resume_from: Checkpoint | None) -> None:
        """Average per-rank state over its holders, then rebind each technique at the synced step
        (`progress`); collectives every rank of the generation calls."""
        same_step = holds_state and held.progress["step"] == progress["step"]
        for own in self._rank_states():
            own.put(average_over_holders(own.get(), held.per_rank[own.name] if same_step else None, self.device))
        for technique in self._all:
            technique.after_sync(held.position, state, progress, resume_from)
        # Whether a checkpoint skips a kept state it wrote before is decided alike by every member
        # (its averages are collectives), and a newcomer wrote none: the generation starts afresh.
        self._last_checkpointed = -1

    def _rank_states(self) -> list[RankState]:
        return [state for technique in self._all for state in technique.rank_states(self._optimizer)]

    # --- a checkpoint --------------------------------------------------------------------
    def checkpoint_state(self, state: RunState, progress: dict[str, Any]
                         ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(states, progress) to checkpoint now, or None if nothing new is to be kept.

        A collective: every rank checkpoints at the same step, and each writes a slice of the
        state, so the parts that differ between ranks are averaged first.
        """
        kept = next((k for t in self._all if (k := t.kept_state(state, progress)) is not None), None)
        if kept is None:
            states = state.states()
        else:
            states, progress = kept  # a run resumes at a state every rank shares
            if progress["step"] == self._last_checkpointed:
                return None
        for own in self._rank_states():
            name, key = own.name, own.key
            states[name] = {**states[name], key: average_over_holders(states[name][key], states[name][key],
                                                                      self.device)}
        self._last_checkpointed = progress["step"]
        return states, progress

    def optimizer_shard(self) -> dict[str, Any] | None:
        """This rank's part of ZeRO's sharded state, the live tensors: a snapshot copies them."""
        return next((shard for t in self._all if (shard := t.optimizer_shard()) is not None), None)

    # --- a sharded model -----------------------------------------------------------------
    def on_module_rebuilt(self, told: Callable[[torch.nn.Module], None]) -> None:
        """Tell `told` of each generation's module where a technique rebuilds it (ZeRO-2/3)."""
        for technique in self._all:
            technique.on_module_rebuilt(told)

    def set_gradient_sync(self, sync: bool) -> None:
        """Whether the backward under way syncs the gradients (ZeRO-2/3's FSDP2 needs telling)."""
        for technique in self._set_gradient_sync:
            technique.set_gradient_sync(sync)


def _acting(techniques: list[Technique], hook: Callable) -> list[Technique]:
    """The techniques whose class overrides `hook`, a no-op of `Technique`."""
    return [t for t in techniques if getattr(type(t), hook.__name__) is not hook]
