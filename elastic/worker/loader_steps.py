"""Ray Train's loop shape: a prepared data loader whose every batch is one global step.

    model = ctx.prepare_model(net)
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = ctx.prepare_data_loader(DataLoader(dataset, batch_size=16))
    for epoch in range(epochs):
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()            # commits the step

`LoaderSteps` runs `ctx.steps(dataset)` underneath: each batch it yields enters the next step,
and the next batch (or the end of the epoch) ends it. A batch is this rank's whole share of the
step's global batch (`DataConfig.global_batch_size`), served from the run's exactly-once cursor.

The same math at any world size: the loop backpropagates its own mean loss over its share, and
the shares differ by a sample where the world size does not divide the global batch. The
gradient reaching the prepared model's output is scaled by the share's weight (its samples times
the data-parallel peers over the step's samples, 1 for even shares), as `mb.backward` scales the
loss, so the averaged gradient is the global batch's mean: the backward through the output is
linear in that gradient.

Healing in place: a peer's death inside the backward fails the gradient all-reduce, which in this
shape does not raise into the loop (`GradientAllReduce`'s failure is kept on the step instead,
and the bucket comes back unreduced); the prepared optimizer's `step()` then does nothing, and
the next batch heals: the step is rolled back, the group re-formed and the state synced, and the
same step's samples come again at the new world size, each rank's share larger. The loop never
sees the failure. A failure raised by the loop's own code (a collective in its forward) is not
hidden: it ends the loop as it would in Ray Train.

A second prepared loader is an evaluation's (`EvaluationShards`): each rank iterates its own
slice of that dataset, with no steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic.config import DataConfig
from elastic.data.loader import is_stream
from elastic.errors import ElasticError
from elastic.worker.step import MicroBatch, Step


ACCUMULATION_FIX = ("give the DataLoader the accumulated batch size (batch_size=k*b, every batch one step), or "
                    "iterate ctx.steps(dataset) with DataConfig(micro_batch_size=b), which accumulates k micro-batches "
                    "in each step and redoes them all after a heal")


class EpochOrder:
    """`loader.sampler` of a prepared loader: `set_epoch` is accepted and does nothing, because
    the run's cursor (seed, epoch) orders every epoch the same way on every rank already."""

    def set_epoch(self, epoch: int) -> None:
        pass


class LoaderSteps:
    """What `ctx.prepare_data_loader(loader)` returns: iterating it yields one epoch of steps.

    At each epoch's start the members agree whether every loop goes on (`loops_go_on`, a one-flag
    all-reduce an epoch, and again where a healed generation redoes the epoch's first step, since a
    newcomer begins its pass there): a loop that returns there ends the run's steps for every member (`end`).
    That is how the run ends without max_steps, and how a newcomer's loop, which began its own
    count of epochs where it joined, stops with the others: its passes left serve nothing.
    """

    def __init__(self, steps: Callable[[], Iterator[Step]], dataset: Any, batch_size: int | None,
                 data_config: DataConfig, optimizer_prepared: Callable[[], bool],
                 loops_go_on: Callable[[bool], bool | None], end: Callable[[], None]) -> None:
        self._open_steps = steps
        self.global_batch_size, self.drop_last = data_config.global_batch_size, data_config.drop_last
        self._optimizer_prepared = optimizer_prepared
        self._loops_go_on = loops_go_on  # None: a peer died in the agreement, and this rank healed
        self._end = end
        self.dataset = dataset
        # An epoch's samples, which tell whether a step ends its epoch; None for a stream, whose epoch
        # ends where it runs dry (the next step says so), whatever its `__len__` says.
        self._epoch_samples = None if is_stream(dataset) else len(dataset)
        self.batch_size = batch_size  # the loader's, as Ray Train users read it
        self.sampler = EpochOrder()
        self._steps: Iterator[Step] | None = None
        self._ended = False  # the run's steps are over: every pass left serves nothing
        self._held: Step | None = None  # entered and handed out: the loop is training it
        self._next: Step | None = None  # the first step of the next epoch, taken from `steps` already
        self._agreed_in: int | None = None  # the generation of the last agreement at an epoch's start
        self._at_epoch_end = False  # a pass ended with its epoch's last step, the next one not yet taken
        # The last step backpropagated and ended without an optimizer step: its gradients may wait
        # in `.grad` for the next batch's (gradient accumulation), which `_weighted` refuses.
        self._unstepped_backward = False
        self.batch: MicroBatch | None = None  # the share handed out for the held step

    def __len__(self) -> int:
        """Steps in an epoch, whatever the world size (a Ray Train loader's length is its
        worker's batches, which change with it): for a schedule's total steps, say."""
        samples, batch = len(self.dataset), self.global_batch_size
        return samples // batch if self.drop_last else -(-samples // batch)

    def __iter__(self) -> Iterator[Any]:
        if self._steps is None:
            self._steps = self._open_steps()
        epoch = None
        while not self._ended:
            if self._end_held():
                # The epoch is over. The boundary after its last step (a switch to a generation that
                # takes in a newcomer, say) comes at the next pass's start, after the loop's own code
                # between epochs (an evaluation in `ctx.between_steps()`), which the newcomer never runs.
                self._at_epoch_end = True
                return
            step, self._next = self._next or next(self._steps, None), None
            self._at_epoch_end = False
            if step is None:
                self._ended = True
                return  # the run reached max_steps
            if epoch is not None and step.cursor.epoch != epoch:
                self._next = step  # the epoch is over; this step opens the next one
                return
            # An epoch's first step offered again in a healed generation is agreed on again: a
            # newcomer there begins its pass with it, and agrees.
            if epoch is None or (step.cursor.consumed == 0 and step.generation != self._agreed_in):
                step = self._agreed(step, going_on=True)
                if step is None:
                    return  # another member's loop returned at this epoch's start: the run ended
                epoch = step.cursor.epoch
            step.__enter__()
            self._held = step
            (self.batch,) = step.micro_batches()  # the share as one batch (`MicroBatching.whole_shares`)
            yield self.batch.data

    def close(self) -> None:
        """The train loop returned: end the step it held (it broke out of a pass), and at an epoch's
        start tell the other members that this loop goes no further."""
        at_epoch_end = self._end_held() or self._at_epoch_end
        step, self._next = self._next, None
        if step is None and at_epoch_end and not self._ended:
            step = next(self._steps, None)  # the boundary after the epoch, and the next epoch's first step
            self._ended = step is None
        if step is not None and not self._ended:
            self._agreed(step, going_on=False)
        if self._steps is not None:
            self._steps.close()

    def _agreed(self, step: Step, going_on: bool) -> Step | None:
        """`step`, offered but not entered, once the members agreed at its epoch's start that every
        loop goes on (the step offered again if a peer died in the agreement and the rank healed);
        None once one loop ended there, which ends the run's steps. A step inside an epoch (a
        newcomer's first) needs no agreement: every member is inside the same pass."""
        while step.cursor.consumed == 0:
            agreed = self._loops_go_on(going_on)
            if agreed is None:
                step = next(self._steps)  # the step again, offered in the healed generation
                continue
            if not agreed:
                self._ended = True
                self._end()
                return None
            self._agreed_in = step.generation
            break
        return step

    def _end_held(self) -> bool:
        """End the step the loop held; True if it committed the last samples of its epoch."""
        step, batch, self._held, self.batch = self._held, self.batch, None, None
        if step is None:
            return False
        if not self._optimizer_prepared():
            raise ElasticError(
                "a step of the prepared data loader ended, and no optimizer stepped the prepared model's parameters "
                "in it: the optimizer's step commits each step. Step an optimizer over model.parameters() after "
                "loss.backward() on every batch (gradient accumulation across batches is not supported: "
                f"{ACCUMULATION_FIX}), and pass it through elastic.prepare_optimizer(optimizer) to sync its state")
        if step.failed is None:
            self._unstepped_backward = batch is not None and batch.weighted and not step.committed
            step.__exit__(None, None, None)
            return step.committed and self._ends_epoch(step)
        failure = dist.DistError(step.failed)  # a peer's failure: the step rolls back, and `steps` heals
        step.__exit__(type(failure), failure, None)
        return False

    def _ends_epoch(self, step: Step) -> bool:
        """Whether `step` takes its epoch's last samples; False for a stream."""
        if self._epoch_samples is None:
            return False
        after = step.cursor.advance(self.global_batch_size, self._epoch_samples, self.drop_last)
        return after.epoch != step.cursor.epoch

    def weigh(self, output: Any, model: torch.nn.Module) -> None:
        """Count the held share as weighted (the optimizer's step checks it) once the backward from
        the prepared model's `output` starts. The weight itself goes on the gradient buckets before
        their all-reduce (`gradient_weight`): on the outputs, a gradient that flows from one output
        through another (a Hugging Face model's loss, through its logits) was weighted twice."""
        batch = self.batch
        if batch is None or not torch.is_grad_enabled():
            return
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, batch=batch: self._weighted(batch, model))

    def gradient_weight(self) -> float:
        """The weight of the held share's gradient (`MicroBatch.weight`): 1 where no share is held."""
        return self.batch.weight if self.batch is not None else 1.0

    def _weighted(self, batch: MicroBatch, model: torch.nn.Module) -> None:
        if self._unstepped_backward:
            self._unstepped_backward = False
            # The backward reaches the parameters only after the outputs: a gradient there now is
            # the last step's, kept for this one. That step committed, and a heal drops `.grad`,
            # which would lose its batch without a word. A batch skipped instead (its gradients
            # zeroed before this backward, or set to None) passes. (Read once, after such a step.)
            if any(p.grad is not None and bool(p.grad.any()) for p in model.parameters()):
                raise ElasticError(
                    f"step {batch.step.index - 1 if batch.step is not None else '?'} of the prepared data loader ended "
                    "after its backward without an optimizer step, and its gradients were still in .grad when this "
                    "batch's backward began: gradient accumulation across the loader's batches. Each batch of a "
                    "prepared loader is a global step, committed at its end; a heal drops what waits in .grad, "
                    f"which would lose those batches. Instead, {ACCUMULATION_FIX} (docs/habits.md)")
        if not batch.weighted:
            batch.weighted = True
            if batch.step is not None:
                batch.step.weighted += 1
            if batch.on_sync is not None:
                batch.on_sync()  # the hang probe: this rank's backward goes on to the all-reduce


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors of a model's output: a tensor, or those inside a tuple, list or
    mapping (a Hugging Face model's output is a mapping)."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield output
    elif isinstance(output, dict) or hasattr(output, "values") and callable(output.values):
        for value in output.values():
            yield from _tensors(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _tensors(value)


class EvaluationShards:
    """What a second `prepare_data_loader` returns (an evaluation's loader, as in Ray Train's
    examples): each pass iterates this rank's slice of the dataset, every world-size-th sample
    from its rank in the generation of the moment, in the loader's batches and collation, on
    the worker's device. It takes no steps; it holds no state a heal must sync."""

    def __init__(self, loader: torch.utils.data.DataLoader, position: Callable[[], tuple[int, int]],
                 to_device: Callable[[Any], Any]) -> None:
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.sampler = EpochOrder()
        self._collate = loader.collate_fn
        self._position = position
        self._to_device = to_device

    def _shard(self) -> torch.utils.data.Subset:
        rank, world_size = self._position()
        return torch.utils.data.Subset(self.dataset, range(rank, len(self.dataset), world_size))

    def __len__(self) -> int:
        return -(-len(self._shard()) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        for batch in torch.utils.data.DataLoader(self._shard(), batch_size=self.batch_size, collate_fn=self._collate):
            yield self._to_device(batch)
