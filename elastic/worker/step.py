"""What the train loop holds in one step: the `Step` (`with step:` heals a lost peer), its
`MicroBatch`es (`mb.backward` weights the loss) and a block of the loop's own collectives
between steps (`BetweenSteps`). A step takes its batches from the worker's `MicroBatching` and
ends through its `Stepping`, both held by the step's maker, the `TrainContext`: `StepOwner` names
what a step calls (`StepBatches`, `StepEnd`), so this module needs nothing of the modules that
implement them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from elastic.comm.generation import landing_failure, peer_failed
from elastic.comm.group import GenerationSpec
from elastic.data import order as data_math
from elastic.errors import ElasticError
from elastic.worker.phases import phase



class StepBatches(Protocol):
    """Where a `Step` takes its share of the global batch (the worker's `MicroBatching`)."""

    def micro_batches(self, step: Step) -> Iterator[MicroBatch]: ...

    def batch(self, step: Step) -> Any: ...


class StepEnd(Protocol):
    """What ends a `Step` (the worker's `Stepping`): its commit, or its rollback when a peer's failure ended it."""

    inside_step: bool  # between a step's __enter__ and __exit__

    def end(self, step: Step, exc: BaseException | None) -> bool: ...


class StepOwner(Protocol):
    """What makes a `Step`: the `TrainContext`, which holds the step's batching and its stepping."""

    batching: StepBatches
    stepping: StepEnd


@dataclass
class MicroBatch:
    """One micro-batch of this rank's share: the collated `data`, its sample `indices`, its `weight`."""

    data: Any
    indices: torch.Tensor
    weight: float
    on_sync: Callable[[], None] | None = None  # called before the backward that syncs gradients
    synced: Callable[[], None] | None = None  # called after it: a replica kind averages across the replicas then
    run_backward: Callable[[torch.Tensor], None] = torch.Tensor.backward  # fp16 scales the loss first
    step: "Step | None" = None  # counts the micro-batches backpropagated here, which the optimizer's step checks
    weighted: bool = False  # went through backward() at least once

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate the micro-batch's mean loss, weighted so the step is the global-batch mean."""
        if self.step is not None and self.step.averaged:
            raise ElasticError("mb.backward() after the step's gradients were averaged across the replicas (a "
                               "run of replicas averages at the last micro-batch's backward): sum the losses "
                               "of a micro-batch and call mb.backward once")
        if self.on_sync is not None:
            self.on_sync()
        if self.step is not None and not self.weighted:
            self.step.weighted += 1
        self.weighted = True
        # A weight of 1 (an even split into one micro-batch a rank) multiplies exactly: leave out
        # the multiply, one autograd node fewer in the step's forward and backward.
        with phase("elastic.backward"):
            self.run_backward(loss if self.weight == 1 else loss * self.weight)
        if self.synced is not None:
            self.synced()


class Step:
    """One optimizer step; use it as `with step:` so a lost peer heals instead of crashing."""

    def __init__(self, ctx: StepOwner, spec: GenerationSpec, index: int, cursor: data_math.DataCursor,
                 samples: int) -> None:
        self._batches = ctx.batching
        self._end = ctx.stepping
        self.index = index
        self.cursor = cursor
        self.samples = samples  # in the whole step, across ranks
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.generation = spec.generation
        self.entered = False
        self.committed = False
        self.optimizer_called = False  # the prepared optimizer's step() was called in it
        self.compute_s: float | None = None
        self.failed: str | None = None
        self.started = 0.0
        # Micro-batches handed out, and those backpropagated with mb.backward: a plain
        # loss.backward() leaves its micro-batch unweighted, which the optimizer's step refuses.
        self.given = 0
        self.weighted = 0
        self.averaged = False  # the gradients were averaged across the replicas (by a replica kind, once)

    def micro_batches(self) -> Iterator[MicroBatch]:
        """This rank's share of the global batch, in micro-batches; gradients sync on the last one."""
        return self._batches.micro_batches(self)

    def batch(self) -> Any:
        """This worker's replica's share of this step as one batch, for a prepared model that cuts
        it into micro-batches itself (`model.step(batch)`)."""
        batch = self._batches.batch(self)
        self.given += 1
        return batch

    def __enter__(self) -> "Step":
        self.entered = True
        self._end.inside_step = True
        self.started = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._end.inside_step = False
        return self._end.end(self, exc)


class BetweenSteps:
    """A block of the train loop's own collectives outside `with step` (an evaluation, say):
    `with ctx.between_steps() as block:`. A peer's death inside it ends the block, this rank
    joins the healed generation at once (`heal`), and `block.failed` holds the error; any other
    exception passes through. On NCCL the block's collectives land before it ends
    (`collectives_landed`), so what it read from them is whole."""

    def __init__(self, heal: Callable[[], None]) -> None:
        self._heal = heal
        self.failed: str | None = None

    def __enter__(self) -> "BetweenSteps":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            exc = landing_failure()  # on NCCL the block's collectives were only queued
        if exc is None or not peer_failed(exc):
            return False
        # Keep the message, not the exception: its traceback would keep the old group alive.
        self.failed = f"{type(exc).__name__}: {exc}"
        self._heal()
        return True
