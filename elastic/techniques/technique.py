"""A technique as a plug-in: one object with the same hooks at every point of a run.

As torchtitan's model converters: each technique a `Strategy` can turn on is a `Technique`
subclass in its own module, built once from the Strategy (`build`, None where it is off), and
`elastic.techniques.strategy.Techniques` calls every built one at each point of a run, in the
order of its list. A hook does nothing here; a technique overrides those it acts at. What a
technique refuses to combine with is declared beside the Strategy (`elastic.config.COMBINATIONS`),
so that a Strategy is refused before torch is imported.

The points, and what the flags say (each read once the Strategy is known, unless noted):

- preparing the model and the optimizer (`prepare_model`, `prepare_optimizer`, `hook_optimizer`);
- around DDP's gradient sync: whether DDP's all-reduce runs at all (`replaces_ddp`), must go
  through the hook (`hooks_gradients`) or keeps torch's bucket size (`keeps_torch_buckets`),
  whether gradients must be the buckets' views (`steps_on_bucket_views`), and what each bucket
  does once reduced (`after_reduce`); the one `Codec` reduces the buckets;
- a step's end: it committed (`committed`) or failed and will be redone (`failed`);
- between steps, once the model is prepared (`acts_between_steps`): a periodic sync
  (`sync_due`, `sync`), the boundary (`at_boundary`), and a planned switch (`drain`);
- a formation (rebinding to a new group): back to a state every holder shares (`rewind`),
  what the rank holds of a sharded state (`position`), and the rebind after the replicated sync
  (`after_sync`);
- its state by kind: replicated (set on the run's `RunState` by `prepare_model`), per rank
  (`rank_states`, averaged over the ranks that held it), sharded (`optimizer_shard`), and the
  state a checkpoint keeps where it is not the live one (`kept_state`);
- what it sent (`bytes_sent`, `syncs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic.checkpoint.checkpoint import Checkpoint
from elastic.comm.state_sync import RunState
from elastic.config import Strategy
from elastic.techniques.shard_plan import ShardPosition


@dataclass(frozen=True)
class Run:
    """What a technique knows of the run besides its Strategy."""

    device: torch.device
    max_steps: int | None
    seed: int


@dataclass(frozen=True)
class RankState:
    """A state each rank keeps for itself: part `key` of registered object `name`'s state dict, read by
    `get` and written by `put`; averaged over the ranks that held it at a formation and a checkpoint."""

    name: str
    key: str
    get: Callable[[], Any]
    put: Callable[[Any], None]


class Technique:
    """One technique on one worker, for every generation of the run."""

    replaces_ddp = False  # syncs gradients or parameters itself: no DDP
    hooks_gradients = False  # DDP's all-reduce must go through the run's hook
    keeps_torch_buckets = False  # DDP keeps torch's bucket size rather than the gloo one
    steps_on_bucket_views = False  # the gradients must be views of DDP's buckets
    shards_optimizer = False  # the optimizer's state is sharded, not registered as replicated
    # Where a step waits for its NCCL collectives to land (`elastic.comm.generation.collectives_landed`):
    # by default the optimizer's first pre-hook does; a technique whose own step waits says so
    # (`lands_in_step`), and one that waits where it applies its own sums, and lands nothing a step,
    # says that (`lands_own_sums`). Every rank must wait as often as its peers: the wait is a collective.
    lands_in_step = False
    lands_own_sums = False
    bytes_sent = 0  # what this rank handed to the technique's collectives
    syncs = 0  # its periodic syncs done

    @classmethod
    def build(cls, strategy: Strategy, run: Run) -> Technique | None:
        """The technique as `strategy` sets it, or None where it is off."""
        raise NotImplementedError

    # --- preparing ----------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, state: RunState) -> None:
        """Create what works on `model`, setting its replicated state on `state`."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, state: RunState) -> torch.optim.Optimizer:
        """The optimizer the train loop steps, given the one the techniques before this one made."""
        return optimizer

    def hook_optimizer(self, optimizer: torch.optim.Optimizer, where: Callable[[], tuple[int, int]],
                       launch: Callable[[torch.Tensor], torch.futures.Future]) -> None:
        """Hook the prepared optimizer's steps; `where` says the step and the world size, `launch`
        starts summing a flat buffer across the generation."""

    # --- around the gradient sync and a step ---------------------------------------------
    def after_reduce(self, future: torch.futures.Future, bucket: dist.GradBucket) -> torch.futures.Future:
        """What a DDP bucket does once its all-reduce lands; a future of its buffer."""
        return future

    def committed(self) -> None:
        """The step committed."""

    def failed(self) -> None:
        """The step in flight failed and will be redone."""

    # --- between steps --------------------------------------------------------------------
    @property
    def acts_between_steps(self) -> bool:
        return False

    def sync_due(self, step: int) -> bool:
        return False

    def sync(self, state: RunState, progress: dict[str, Any]) -> None:
        """The periodic sync after committed step `progress["step"]`; raises if a peer died in it."""

    def at_boundary(self, state: RunState, progress: Any) -> None:
        """A step boundary (`progress`: the run's `Progress`)."""

    def drain(self) -> None:
        """Before a planned switch: finish what is in flight; raises if a peer died."""

    # --- a formation ------------------------------------------------------------------------
    def rewind(self, state: RunState, progress: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Before the replicated sync, on a rank that holds state: go back to a state every holder shares;
        (the progress to sync from, the committed steps undone)."""
        return progress, 0

    def position(self) -> ShardPosition | None:
        """The sharded state this rank holds, to rebind from."""
        return None

    def after_sync(self, position: ShardPosition | None, state: RunState, progress: dict[str, Any],
                   resume_from: Checkpoint | None) -> None:
        """Rebind to the new generation at the synced step (`progress`); a collective of its ranks.
        `position`: what this rank held, None where it held nothing usable."""

    # --- its state by kind ---------------------------------------------------------------------
    def rank_states(self, optimizer: torch.optim.Optimizer | None) -> list[RankState]:
        """The states this rank keeps for itself (`optimizer`: the prepared one, if any)."""
        return []

    def kept_state(self, state: RunState, progress: dict[str, Any]
                   ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(states, progress) a checkpoint keeps in place of the live ones, or None to keep the live ones."""
        return None

    def optimizer_shard(self) -> dict[str, Any] | None:
        """This rank's part of a sharded optimizer state, the live tensors: a snapshot copies them."""
        return None

    # --- a sharded model ---------------------------------------------------------------------
    def on_module_rebuilt(self, told: Callable[[torch.nn.Module], None]) -> None:
        """Tell `told` of each generation's module, where the technique rebuilds it."""

    def set_gradient_sync(self, sync: bool) -> None:
        """Whether the backward under way syncs the gradients (the step's last micro-batch)."""


class Codec(Technique):
    """The technique that reduces DDP's gradient buckets: exactly one per run."""

    def all_reduce(self, bucket: dist.GradBucket,
                   reduce: Callable[[torch.Tensor], torch.futures.Future]) -> torch.futures.Future:
        """Average the bucket across ranks through `reduce` (a summing all-reduce returning a future
        of its tensor); a future of the bucket's averaged buffer."""
        raise NotImplementedError
