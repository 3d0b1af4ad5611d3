"""Mixed precision: the prepared model's forward under autocast, and fp16's loss scaling.

bf16 keeps fp32's exponent range, so autocast is all it needs. fp16 does not: small
gradients underflow, so the loss is multiplied by a scale before the backward and the
gradients divided by it before the optimizer steps (`torch.amp.GradScaler`). A step whose
gradients overflowed is skipped and the scale halved. Under DDP every rank unscales the same
all-reduced gradients, so every rank finds the same overflow and skips the same steps; the
scaler's state (scale, growth tracker) is registered with the run, so a heal or a grow hands
it to newcomers with the model and a checkpoint keeps it.

The forward's floating outputs are cast back to fp32, as Ray Train's `accelerate(amp=True)`
does, so a loss computed outside autocast works unchanged. Only the tensors are cast: the output
keeps its type and structure (a Hugging Face `ModelOutput`, an OrderedDict, a namedtuple, a
dataclass, lists and tuples, nested), through torch's pytree and, for containers pytree does not
know, a copy of the container with its items cast.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import types
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

from elastic.comm.generation import collectives_landed
from elastic.comm.state_sync import RunState
from elastic.config import Strategy
from elastic.techniques.technique import Run, Technique

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision(Technique):
    """One run's precision on one worker: autocast for the forward, loss scaling for fp16. Every run
    has one (fp32 is a precision too)."""

    def __init__(self, mode: str, device: torch.device) -> None:
        self.device = device
        self.dtype = DTYPES.get(mode)
        self.scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
        self.lands_in_step = self.scaler is not None  # before the unscale (`wrap_step`)
        self._stepping = False

    @classmethod
    def build(cls, strategy: Strategy, run: Run) -> Precision:
        return cls(strategy.precision, run.device)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, state: RunState) -> torch.optim.Optimizer:
        """Register fp16's loss scaler as replicated state and wrap the optimizer's step in it."""
        if self.scaler is not None:
            state.grad_scaler = self.scaler
            self.wrap_step(optimizer)
        return optimizer

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast to the run's dtype (nothing under fp32)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def forward(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`call(*args, **kwargs)` under autocast, its floating outputs back in fp32."""
        if self.dtype is None:
            return call(*args, **kwargs)
        with self.autocast():
            out = call(*args, **kwargs)
        return _to_fp32(out)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` unscale, skip on overflow and update the scale (fp16 only).

        GradScaler.step calls `optimizer.step` itself, which is this wrapper again: the inner
        call goes straight to the optimizer's own step. An optimizer that counts the steps its
        state has seen (ZeRO's `ShardedOptimizer`) is told of a skipped one through `skip_step`.
        """
        if self.scaler is None:
            return
        own_step = optimizer.step
        stepped = []

        @functools.wraps(own_step)
        def step(bound: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if self._stepping:
                stepped.append(True)
                return own_step(*args, **kwargs)
            self._stepping = True
            stepped.clear()
            try:
                # Before the unscale reads the gradients for infs: on NCCL their all-reduce was only queued.
                collectives_landed()
                value = self.scaler.step(bound, *args, **kwargs)
            except BaseException:
                # The step failed (a peer's failure heals, and the step is redone): the scaler forgets
                # that it unscaled these gradients, or the redo would skip its unscale, as torch's
                # `update()` makes it forget after a step.
                self.scaler._per_optimizer_states.pop(id(bound), None)
                raise
            finally:
                self._stepping = False
            self.scaler.update()
            if not stepped and hasattr(bound, "skip_step"):
                bound.skip_step()
            return value

        # A bound method, as the optimizer's own: LR schedulers wrap `optimizer.step.__func__`.
        optimizer.step = types.MethodType(step, optimizer)


def _to_fp32(value: Any) -> Any:
    """`value` with every bf16 and fp16 tensor in it cast to fp32, its containers' types kept."""
    return pytree.tree_map(_leaf_to_fp32, value)


def _leaf_to_fp32(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf.float() if leaf.dtype in (torch.bfloat16, torch.float16) else leaf
    if isinstance(leaf, MutableMapping):  # a dict subclass pytree does not know
        cast = copy.copy(leaf)
        for key in list(cast.keys()):
            cast[key] = _to_fp32(cast[key])
        return cast
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        fields = {f.name: _to_fp32(getattr(leaf, f.name)) for f in dataclasses.fields(leaf) if f.init}
        return dataclasses.replace(leaf, **fields)
    return leaf
