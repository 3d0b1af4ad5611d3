"""ZeRO as a technique (`Strategy(zero=1, 2 or 3)`): the optimizer's state sharded across the ranks
(stage 1, `elastic.techniques.zero`), with the gradients and parameters too (stages 2 and 3 on FSDP2,
`elastic.techniques.fsdp`), each rank's shards resharded point to point when a generation forms.

FSDP2 (torch >= 2.6) is imported only by the runs that use it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from elastic.checkpoint.checkpoint import Checkpoint
from elastic.comm.state_sync import RunState
from elastic.config import Strategy
from elastic.techniques.shard_plan import ShardPosition
from elastic.techniques.technique import Run, Technique
from elastic.techniques.zero import ShardedOptimizer


class ZeRO(Technique):
    """One worker's ZeRO shards, for every generation of the run."""

    shards_optimizer = True

    def __init__(self, stage: int, replicas: int) -> None:
        self._stage, self._replicas = stage, replicas
        self.replaces_ddp = stage >= 2  # FSDP2 reduce-scatters the gradients itself
        self.lands_in_step = stage >= 2  # the shards step once the reduce-scatter landed (`ShardedParamsOptimizer`)
        self._optimizer: ShardedOptimizer | None = None  # stage 1, made by prepare_optimizer
        self._sharded: Any = None  # stages 2 and 3: a FullyShardedModel, made by prepare_model

    @classmethod
    def build(cls, strategy: Strategy, run: Run) -> ZeRO | None:
        return cls(strategy.zero, strategy.zero_replicas) if strategy.zero else None

    def prepare_model(self, model: torch.nn.Module, state: RunState) -> None:
        if self._stage < 2:
            return
        from elastic.techniques.fsdp import FullyShardedModel, ShardedBuffers

        self._sharded = FullyShardedModel(model, self._stage, self._replicas)
        state.model = ShardedBuffers(self._sharded)  # the parameters are sharded, not synced whole

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, state: RunState) -> torch.optim.Optimizer:
        if self._sharded is not None:
            return self._sharded.adopt(optimizer)
        self._optimizer = ShardedOptimizer(optimizer, replicas=self._replicas)
        return self._optimizer

    def position(self) -> ShardPosition | None:
        holder = self._holder()
        return holder.position if holder is not None else None

    def after_sync(self, position: ShardPosition | None, state: RunState, progress: dict[str, Any],
                   resume_from: Checkpoint | None) -> None:
        """Reshard at the synced step; where no rank holds shards, from the checkpoint's pieces."""
        if self._optimizer is not None:
            self._optimizer.reshard(position, steps=progress["step"], restoring=resume_from is not None)
            if resume_from is not None:
                self._optimizer.load_sharded(resume_from.load_optimizer_shards(self._optimizer.wants_piece))
        if self._sharded is not None:
            pieces = resume_from.load_optimizer_shards(self._sharded.wants_piece) if resume_from is not None else []
            if pieces:
                self._sharded.check_pieces(pieces)
            self._sharded.form(position, steps=progress["step"], pieces=pieces)

    def optimizer_shard(self) -> dict[str, Any] | None:
        holder = self._holder()
        return holder.sharded_state_dict() if holder is not None else None

    def on_module_rebuilt(self, told: Callable[[torch.nn.Module], None]) -> None:
        self._sharded.on_rebuilt = told

    def set_gradient_sync(self, sync: bool) -> None:
        self._sharded.set_requires_gradient_sync(sync)

    def _holder(self) -> Any:
        """What holds the shards: the sharded optimizer (stage 1) or the sharded model (2, 3); None before."""
        return self._optimizer if self._optimizer is not None else self._sharded

