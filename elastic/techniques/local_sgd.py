"""Local SGD, DiLoCo and EASGD: ranks step alone and meet every H steps; rescales happen only there.

Between syncs each rank trains on its own share of every global batch with the user's
optimizer (the inner one) and sends nothing. Every H committed steps, and at the run's last
step, the ranks sync:

- local SGD averages the parameters;
- DiLoCo all-reduces the pseudo-gradient (the parameters of the last sync minus each rank's
  own, averaged) and an outer Nesterov SGD steps the last-sync parameters with it; every
  rank then starts the next interval from them;
- EASGD (elastic averaging SGD, Zhang, Choromanska & LeCun 2015) pulls each rank's
  parameters x_i and a replicated center x~ toward each other: d_i = alpha (x_i - x~),
  x_i -= d_i, x~ += sum_i d_i (one all-reduce of the d_i). The ranks keep their own x_i, so
  they differ after a sync; the center is the run's model, and the last sync sets every
  x_i to it.

With H=1 (and DiLoCo's outer SGD at lr 1 without momentum) local SGD and DiLoCo are DDP: each
rank's gradient is weighted so that their average is the global batch's
(`data.gradient_weight`).

The elastic rule. Only at a sync is everything but EASGD's x_i (the outer optimizer, the
last-sync parameters or the center, registered state, the data cursor) replicated, so the
controller aligns every planned switch to a multiple of H. A death in mid-interval cannot
wait: every rank rolls back to what it held at the last sync (the `Backup` taken there) and
the interval's global batches are replayed over the new world, so each sample still counts
once, at interval granularity. The heal then syncs as always. Under EASGD every rank then
restarts from the center, x_i := x~, at every new generation (heal, grow or restart): a
newcomer has no x_i of its own, so this is the one rule that treats all ranks alike. It
resets the ranks' exploration, an approximation of EASGD's trajectory, which depends on the
number of ranks anyway. A checkpoint holds the center as the model, so a resumed run starts
from it too.

The inner optimizer's state is each rank's own. At every new generation it is replaced by
its average over the ranks that held it at the synced step, newcomers included in receiving
it: exact for optimizers linear in their state (SGD with momentum) on a planned rescale, an
approximation after a death (the survivors' average) and for Adam.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.checkpoint import Checkpoint
from elastic.comm.flat_state import flatten, unflatten
from elastic.comm.generation import collectives_landed
from elastic.comm.state_sync import RunState, load_into
from elastic.config import Strategy
from elastic.techniques.shard_plan import ShardPosition
from elastic.techniques.technique import RankState, Run, Technique


class OuterSync:
    """The periodic sync of one run on one worker; registered with the run as replicated state."""

    def __init__(self, options: Mapping[str, Any], model: torch.nn.Module, max_steps: int) -> None:
        self.kind = options["kind"]
        self.every = options["every"]
        self.max_steps = max_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.syncs = 0  # all-reduces done, and the bytes this rank handed to them
        self.bytes_sent = 0
        self.outer: torch.optim.Optimizer | None = None
        # The replicated parameters the ranks meet at: DiLoCo's last-sync parameters, EASGD's center.
        self.anchor: list[torch.Tensor] = []
        if self.kind in ("diloco", "easgd"):
            self.anchor = [p.detach().clone() for p in self.params]
        if self.kind == "diloco":
            momentum = options["outer_momentum"]
            self.outer = torch.optim.SGD(self.anchor, lr=options["outer_lr"], momentum=momentum,
                                         nesterov=momentum > 0)
        self.alpha: float | None = options.get("alpha")  # EASGD's pull toward the center
        # Each model state_dict key that holds a parameter, with its index (tied weights: several keys).
        index = {id(p): i for i, p in enumerate(self.params)}
        self._keys = {key: index[id(t)] for key, t in model.state_dict(keep_vars=True).items() if id(t) in index}

    def due(self, step: int) -> bool:
        """Whether committed step `step` ends an interval (the run's last step ends one too)."""
        return step % self.every == 0 or step == self.max_steps

    def sync(self, step: int) -> None:
        """The interval's collective after committed step `step`: average the parameters, DiLoCo's
        outer step, or EASGD's elastic pull (whose last one leaves every rank at the center)."""
        world_size = dist.get_world_size()
        with torch.no_grad():
            if self.kind == "local_sgd":
                flat = torch.cat([p.reshape(-1) for p in self.params])
                self.bytes_sent += flat.numel() * flat.element_size()
                _sum_landed(flat)
                flat.div_(world_size)
                self._unflatten_into(flat, self.params)
            elif self.kind == "diloco":
                flat = torch.cat([(a - p).reshape(-1) for a, p in zip(self.anchor, self.params)])
                self.bytes_sent += flat.numel() * flat.element_size()
                _sum_landed(flat)
                flat.div_(world_size)
                for anchor, grad in zip(self.anchor, self._split(flat)):
                    anchor.grad = grad
                self.outer.step()
                self.outer.zero_grad(set_to_none=True)
                for param, anchor in zip(self.params, self.anchor):
                    param.copy_(anchor)
            else:
                flat = torch.cat([(p - a).reshape(-1) for p, a in zip(self.params, self.anchor)]).mul_(self.alpha)
                self.bytes_sent += flat.numel() * flat.element_size()
                _sum_landed(flat)  # sum_i d_i; nothing has moved yet if a peer dies in it
                for param, anchor, total in zip(self.params, self.anchor, self._split(flat)):
                    param.sub_((param - anchor).mul_(self.alpha))  # d_i again, bit for bit, not kept meanwhile
                    anchor.add_(total)
                if step == self.max_steps:
                    self.start_from_center()  # the run ends with the center as its model
        self.syncs += 1

    def start_from_center(self) -> None:
        """EASGD at a new generation (and its last sync): every rank's parameters := the center."""
        if self.kind != "easgd":
            return
        with torch.no_grad():
            for param, anchor in zip(self.params, self.anchor):
                param.copy_(anchor)

    def model_to_checkpoint(self, model: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        """The model's state to checkpoint, given its state and this object's (`own`) at a sync:
        under EASGD the center in place of the rank's own parameters, the same on every rank."""
        if self.kind != "easgd":
            return model
        return {**model, **{key: own["anchor"][i] for key, i in self._keys.items()}}

    def state_dict(self) -> dict[str, Any]:
        if not self.anchor:
            return {}
        state: dict[str, Any] = {"anchor": [a.detach() for a in self.anchor]}
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.anchor:
            return
        with torch.no_grad():
            for anchor, value in zip(self.anchor, state["anchor"]):
                anchor.copy_(value)
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in self.params]), self.params)]

    def _unflatten_into(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        for tensor, part in zip(tensors, self._split(flat)):
            tensor.copy_(part)


class Backup:
    """Copies of every registered object and the progress at the last sync, to roll back to."""

    def __init__(self) -> None:
        self._copy: tuple[Any, dict[str, torch.Tensor]] | None = None

    def take(self, state: RunState, progress: dict[str, Any]) -> None:
        payload = {"progress": progress, "state": state.states()}
        structure, buffers = flatten(payload, torch.device("cpu"))
        self._copy = (structure, buffers)

    @property
    def step(self) -> int | None:
        return None if self._copy is None else self._copy[0]["progress"]["step"]

    def states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the objects' states, the progress) as of the last sync, as new tensors."""
        payload = unflatten(*self._copy)
        return payload["state"], payload["progress"]

    def restore(self, state: RunState) -> dict[str, Any]:
        """Put every object back as it was at the last sync; returns that sync's progress."""
        states, progress = self.states()
        for name, holder in state.items():
            load_into(holder, states[name])
        return progress



class PeriodicSync(Technique):
    """`Strategy(sync="local_sgd:..." / "diloco:..." / "easgd:...")` as a technique: the `OuterSync` of the
    prepared model, the `Backup` of its last sync to roll back to, the inner optimizer's state per rank."""

    replaces_ddp = True  # it syncs parameters, not gradients
    lands_own_sums = True  # at each sync

    def __init__(self, options: Mapping[str, Any], max_steps: int | None) -> None:
        self._options, self._max_steps = options, max_steps
        self._outer: OuterSync | None = None  # made by prepare_model
        self._backup = Backup()

    @classmethod
    def build(cls, strategy: Strategy, run: Run) -> PeriodicSync | None:
        options = strategy.sync_options
        return cls(options, run.max_steps) if options.kind in ("local_sgd", "diloco", "easgd") else None

    def prepare_model(self, model: torch.nn.Module, state: RunState) -> None:
        self._outer = state.outer_sync = OuterSync(self._options, model, self._max_steps)

    @property
    def acts_between_steps(self) -> bool:
        return self._outer is not None

    def sync_due(self, step: int) -> bool:
        return self._outer is not None and self._outer.due(step)

    def sync(self, state: RunState, progress: dict[str, Any]) -> None:
        self._outer.sync(progress["step"])
        self._backup.take(state, progress)

    def rewind(self, state: RunState, progress: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Back to the last sync, the only point where the state is the same on every rank (the
        interval is then replayed)."""
        if self._outer is None or self._backup.step in (None, progress["step"]):
            return progress, 0
        restored = self._backup.restore(state)
        return restored, progress["step"] - restored["step"]

    def after_sync(self, position: ShardPosition | None, state: RunState, progress: dict[str, Any],
                   resume_from: Checkpoint | None) -> None:
        if self._outer is not None:
            self._outer.start_from_center()  # EASGD: every rank starts the generation from the center
            self._backup.take(state, progress)

    def rank_states(self, optimizer: torch.optim.Optimizer | None) -> list[RankState]:
        """The inner optimizer's state: each rank stepped it alone since the last sync."""
        if self._outer is None or optimizer is None:
            return []
        return [RankState("optimizer", "state", lambda: optimizer.state_dict()["state"],
                          lambda state: optimizer.load_state_dict({**optimizer.state_dict(), "state": state}))]

    def kept_state(self, state: RunState, progress: dict[str, Any]
                   ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The last sync's state, where a run resumes; under EASGD with the center as the model."""
        if self._outer is None:
            return None
        states, progress = self._backup.states()
        states["model"] = self._outer.model_to_checkpoint(states["model"], states["outer_sync"])
        return states, progress

    @property
    def bytes_sent(self) -> int:
        return self._outer.bytes_sent if self._outer is not None else 0

    @property
    def syncs(self) -> int:
        return self._outer.syncs if self._outer is not None else 0


def _sum_landed(flat: torch.Tensor) -> None:
    """Sum `flat` across the generation in place, and wait for it to land: on NCCL the all-reduce is
    only queued, and the parameters written from a sum a dead peer broke off would be no rank's."""
    dist.all_reduce(flat)
    collectives_landed()
