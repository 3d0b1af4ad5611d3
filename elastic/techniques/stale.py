"""Stale-synchronous data parallelism (`Strategy(sync="stale:bound=S")`): a step's gradient
all-reduce runs while the next S steps compute.

Each step t computes this rank's weighted share of the global batch's gradient, as under DDP,
and starts its all-reduce without waiting (`before_step`). The optimizer then steps with the
averaged gradient of step t - S, waiting for that reduction only (Ho et al., "More Effective
Distributed ML via a Stale Synchronous Parallel Parameter Server", 2013, on an all-reduce). No
rank applies a gradient more than S steps old, and none runs more than S steps ahead of the
group's oldest unfinished reduction. The first S steps apply nothing; the run's last step
applies every gradient still in flight, so the run ends having applied each step's once. With
S = 0 each step applies its own averaged gradient: DDP.

The elastic rule. A step's state is complete only once every gradient in flight at it has
arrived: the model and optimizer, together with those S averaged gradients, which are the same
at any world size. The live state is complete only when nothing is in flight, so this module
keeps a base, the complete state S steps back, which it moves forward as the reductions arrive
(`at_boundary`): a copy of the model's parameters and the optimizer (`_Base`) that repeats
each optimizer step the live one took S steps earlier, with the same averaged gradient and
hyperparameters, and a CPU copy of everything else registered (buffers, the user's state,
random streams, the data cursor) as of that step.

- A death loses the broken group's reductions in flight: every survivor rolls back to its base
  (`roll_back`), the heal's sync takes the newest base among them, and the S steps since are
  replayed at the new world size. Every base lies on the run's one trajectory, so the run
  stays exact and each sample counts once.
- A planned switch (a grow) waits for the reductions in flight first (`drain`): nothing is
  lost, and the pause is at most S steps of communication.
- A checkpoint holds the base (complete) state, with its averaged gradients to apply.

Memory: one copy of the model's parameters and of the optimizer's state, and the S averaged
gradients the base still has to apply, besides the S in flight that stale synchrony needs
anyway; per step, a CPU copy of the small state (buffers and registered objects other than the
model and optimizer). CPU: the base repeats each optimizer step once.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from elastic.checkpoint.checkpoint import Checkpoint
from elastic.comm.flat_state import flatten, unflatten
from elastic.comm.generation import collectives_landed
from elastic.comm.state_sync import RunState, load_into, state_of
from elastic.config import StaleSpec, Strategy
from elastic.techniques.shard_plan import ShardPosition
from elastic.techniques.technique import Run, Technique

# Registered objects that the base copies itself, and this module's own.
OWN_OBJECTS = ("model", "optimizer", "stale")


@dataclass
class _Reduction:
    """One step's gradient all-reduce: its flat buffer, summed in place, and the future to wait on
    (None once it arrived and was averaged)."""

    flat: torch.Tensor
    world_size: int
    future: torch.futures.Future | None = None

    def wait(self) -> torch.Tensor:
        if self.future is not None:
            self.future.wait()
            self.future = None
            self.flat.div_(self.world_size)
        return self.flat


@dataclass
class _Step:
    """What one committed step did, for the base to repeat S steps later."""

    launched: _Reduction  # its own gradient's all-reduce
    applied: bool  # whether it stepped the optimizer with the oldest arrived gradient
    hyper: list[dict[str, Any]]  # the optimizer's hyperparameters at that step
    after: tuple[Any, dict[str, torch.Tensor]] | None = None  # the rest of the state at its end (flattened)


@dataclass
class _Base:
    """The complete state S steps back: parameters and optimizer (a twin of the live one), the
    reductions it has yet to apply (all arrived), and the rest of the state, flattened."""

    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]  # the twin's, in the live optimizer's order
    pending: collections.deque = field(default_factory=collections.deque)
    rest: tuple[Any, dict[str, torch.Tensor]] | None = None


class StaleSync:
    """Stale-synchronous gradient averaging on one worker; registered with the run as `stale`,
    whose state (the averaged gradients yet to apply) every rank of a generation shares."""

    def __init__(self, bound: int, model: torch.nn.Module, max_steps: int) -> None:
        self.bound = bound
        self.model = model
        self.max_steps = max_steps
        self.params: list[torch.Tensor] = []  # the optimizer's, in its order: the flat gradients' layout
        self.bytes_sent = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._where: Callable[[], tuple[int, int]] | None = None  # given by `adopt`, as is `_launch`
        self._launch: Callable[[torch.Tensor], torch.futures.Future] | None = None
        self._in_flight: collections.deque[_Reduction] = collections.deque()  # oldest first
        self._taken: collections.deque[_Step] = collections.deque()  # steps the live state took, not the base
        self._open: _Step | None = None  # the step under way, until its boundary
        self._base: _Base | None = None
        self._draining = False

    # --- the live steps -------------------------------------------------------------------
    def adopt(self, optimizer: torch.optim.Optimizer, where: Callable[[], tuple[int, int]],
              launch: Callable[[torch.Tensor], torch.futures.Future]) -> None:
        """Hook `optimizer`: its steps go through `before_step` and `after_step`. `where` says the
        step under way and the world size; `launch` starts summing a flat buffer across the
        generation (`Membership.launch_average`), a future."""
        self._optimizer, self._where, self._launch = optimizer, where, launch
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.register_step_pre_hook(lambda *_: self.before_step())
        optimizer.register_step_post_hook(lambda *_: self.after_step())

    def before_step(self) -> None:
        """Start this step's all-reduce and put the gradient of S steps ago in the parameters'
        `.grad` (none in the first S steps, so the optimizer leaves them)."""
        if self._draining:
            return
        _, world_size = self._where()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        self.bytes_sent += flat.numel() * flat.element_size()
        applies = len(self._in_flight) + 1 > self.bound
        if applies and self.bound > 0:
            # On NCCL the reduction to apply, launched steps ago, must have landed; waiting before this
            # step's launch keeps this one in flight meanwhile (a no-op on gloo).
            collectives_landed()
        reduction = _Reduction(flat, world_size, self._launch(flat))
        self._in_flight.append(reduction)
        if applies and self.bound == 0:
            collectives_landed()  # bound 0 applies this step's own reduction
        self._open = _Step(reduction, applies, _hyper(self._optimizer))
        self._set_gradients(self.params, self._in_flight.popleft().wait() if applies else None)

    def after_step(self) -> None:
        """Leave the averaged gradient to the base; at the run's last step apply every one still in flight."""
        if self._draining:
            return
        self._set_gradients(self.params, None)
        step_index, _ = self._where()
        if step_index != self.max_steps - 1:
            return
        self._draining = True
        try:
            collectives_landed()  # on NCCL the sums still in flight were only queued
            while self._in_flight:
                self._set_gradients(self.params, self._in_flight.popleft().wait())
                self._optimizer.step()
                self._set_gradients(self.params, None)
        finally:
            self._draining = False

    def drain(self) -> None:
        """Wait for every reduction in flight (before a planned switch): the live state is then
        complete. Raises the peer failure if one breaks."""
        for reduction in self._in_flight:
            reduction.wait()

    def at_boundary(self, state: RunState, progress: dict[str, Any]) -> None:
        """A step boundary: keep what the step that ended left, and move the base up to S steps behind."""
        if self._open is None:
            return  # no step since the last boundary or formation
        step, self._open = self._open, None
        step.after = flatten(self._rest(state, progress), torch.device("cpu"))
        self._taken.append(step)
        while len(self._taken) > self.bound:
            self._advance(self._taken.popleft())

    # --- a formation ------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Every gradient in flight has arrived: the live state is a complete one."""
        return all(r.future is None for r in self._in_flight)

    def roll_back(self, state: RunState, progress: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Put the live state back at the base, if it is not complete itself; (the progress to
        sync from, the committed steps undone)."""
        self._open = None
        if self.complete or self._base is None:
            return progress, 0
        base = self._base
        with torch.no_grad():
            for live, kept in zip(self.params, base.params):
                live.copy_(kept)
        self._optimizer.load_state_dict(_copied(base.optimizer.state_dict()))
        rest = unflatten(*base.rest)
        self._load_rest(state, rest)
        self._in_flight = collections.deque(base.pending)
        self._taken.clear()
        return rest["progress"], progress["step"] - rest["progress"]["step"]

    def rebase(self, state: RunState, progress: dict[str, Any]) -> None:
        """After a formation's sync: the live state is complete, and becomes the base."""
        self._open = None
        self._taken.clear()
        if self._base is None:
            twin = copy.deepcopy(self._optimizer)
            twin._optimizer_step_pre_hooks.clear()  # the live optimizer's hooks commit steps
            twin._optimizer_step_post_hooks.clear()
            self._base = _Base(twin, [p for group in twin.param_groups for p in group["params"]])
        base = self._base
        with torch.no_grad():
            for kept, live in zip(base.params, self.params):
                kept.copy_(live)
        base.optimizer.load_state_dict(_copied(self._optimizer.state_dict()))
        base.pending = collections.deque(self._in_flight)
        base.rest = flatten(self._rest(state, progress), torch.device("cpu"))

    # --- a checkpoint ---------------------------------------------------------------------
    def committed_state(self, state: RunState, progress: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(states, progress) of the newest complete state: the live one if it is, else the base."""
        if self.complete or self._base is None:
            return state.states(), progress
        base = self._base
        rest = unflatten(*base.rest)
        twin = dict(zip(map(id, self.params), base.params))
        model = {key: twin.get(id(t), t).detach() for key, t in self.model.state_dict(keep_vars=True).items()}
        model.update(rest["buffers"])
        optimizer = base.optimizer.state_dict()
        _put_hyper(optimizer["param_groups"], rest["hyper"])
        states = {**rest["objects"], "model": model, "optimizer": optimizer,
                  "stale": {"pending": [r.flat for r in base.pending]}}
        return states, rest["progress"]

    # --- registered state: the averaged gradients yet to apply -------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"pending": [r.wait() for r in self._in_flight]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._in_flight = collections.deque(_Reduction(flat.clone(), 1) for flat in state["pending"])

    # --- helpers ----------------------------------------------------------------------------
    def _advance(self, step: _Step) -> None:
        """Repeat on the base the optimizer step the live state took S steps ago."""
        base = self._base
        base.pending.append(step.launched)
        if step.applied:
            _put_hyper(base.optimizer.param_groups, step.hyper)
            self._set_gradients(base.params, base.pending.popleft().wait())
            base.optimizer.step()
            self._set_gradients(base.params, None)
        base.rest = step.after

    def _rest(self, state: RunState, progress: dict[str, Any]) -> dict[str, Any]:
        return {"objects": {name: state_of(holder) for name, holder in state.items() if name not in OWN_OBJECTS},
                "buffers": {name: b.detach() for name, b in self.model.named_buffers()},
                "hyper": _hyper(self._optimizer), "progress": progress}

    def _load_rest(self, state: RunState, rest: dict[str, Any]) -> None:
        for name, kept in rest["objects"].items():
            load_into(state.holder(name), kept)
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, value in rest["buffers"].items():
                buffers[name].copy_(value)
        _put_hyper(self._optimizer.param_groups, rest["hyper"])

    def _set_gradients(self, params: list[torch.Tensor], flat: torch.Tensor | None) -> None:
        offset = 0
        for p in params:
            if flat is None:
                p.grad = None
                continue
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


class StaleSynchrony(Technique):
    """`Strategy(sync="stale:bound=S")` as a technique: the `StaleSync` of the prepared model and optimizer."""

    replaces_ddp = True  # it all-reduces each step's whole gradient itself
    lands_own_sums = True  # before a step applies a sum launched steps ago

    def __init__(self, bound: int, max_steps: int | None) -> None:
        self._bound, self._max_steps = bound, max_steps
        self._stale: StaleSync | None = None  # made by prepare_model

    @classmethod
    def build(cls, strategy: Strategy, run: Run) -> StaleSynchrony | None:
        spec = strategy.sync_options
        return cls(spec.bound, run.max_steps) if isinstance(spec, StaleSpec) else None

    def prepare_model(self, model: torch.nn.Module, state: RunState) -> None:
        self._stale = state.stale = StaleSync(self._bound, model, self._max_steps)

    def hook_optimizer(self, optimizer: torch.optim.Optimizer, where: Callable[[], tuple[int, int]],
                       launch: Callable[[torch.Tensor], torch.futures.Future]) -> None:
        if self._stale is not None:
            self._stale.adopt(optimizer, where, launch)

    @property
    def acts_between_steps(self) -> bool:
        return self._stale is not None

    def at_boundary(self, state: RunState, progress: Any) -> None:
        """Keep what the step left, S steps behind."""
        if self._stale is not None:
            self._stale.at_boundary(state, progress.to_dict())

    def drain(self) -> None:
        if self._stale is not None:
            self._stale.drain()

    def rewind(self, state: RunState, progress: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Back to the complete state S steps behind, where gradients were still in flight."""
        if self._stale is None:
            return progress, 0
        return self._stale.roll_back(state, progress)

    def after_sync(self, position: ShardPosition | None, state: RunState, progress: dict[str, Any],
                   resume_from: Checkpoint | None) -> None:
        if self._stale is not None:
            self._stale.rebase(state, progress)

    def kept_state(self, state: RunState, progress: dict[str, Any]
                   ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The newest complete state, where a run resumes."""
        return self._stale.committed_state(state, progress) if self._stale is not None else None

    @property
    def bytes_sent(self) -> int:
        return self._stale.bytes_sent if self._stale is not None else 0


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict with tensors of its own: `load_state_dict` keeps the tensors it is
    given where their dtype and device fit, and the twin must not step the live optimizer's."""
    return copy.deepcopy(state)


def _hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (a scheduler may change them between steps)."""
    return [copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups]


def _put_hyper(groups: list[dict[str, Any]], hyper: list[dict[str, Any]]) -> None:
    for group, values in zip(groups, hyper):
        group.update(copy.deepcopy(values))
