"""The optimizer stepped bucket by bucket as DDP's all-reduces land (`Strategy(overlap_optimizer=True)`).

Plain DDP overlaps the gradient all-reduce with the backward pass only; the optimizer waits for
the last bucket, then steps over every parameter. Over a link slower than compute the step is
then forward + all-reduce + optimizer. Here each bucket's parameters are stepped, on a thread of
their own, as soon as that bucket's all-reduce returns, while the next buckets are still on the
wire: the step becomes forward + all-reduce + the last bucket's share of the optimizer (torch's
`_hook_then_optimizer` does this for its functional optimizers; this one steps the run's own
optimizer, whose state heals and checkpoints as before).

What the train loop sees: `optimizer.step()` waits for the buckets' steps, then steps the
parameters no bucket carried and runs the optimizer's hooks (so the step still commits where
it did; a post hook sees only those parameters in `param_groups`). Gradients are
DDP's bucket views (`gradient_as_bucket_view`), so a bucket's parameters read the averaged
gradient the moment its all-reduce lands.

Exact, and rolled back like any failed step: before a bucket's parameters are stepped, they and
their optimizer state are copied; a step that fails after some buckets stepped (a peer died in a
later all-reduce) copies them back, so every rank is at the step's start again. The copies cost
one extra pass over the parameters and the optimizer state per step, on the same thread, while
the link is busy.

Correct for optimizers that update each parameter from its own gradient and state (SGD, Adam,
AdamW, RMSprop...) and write nothing into their param groups while stepping. Anything the loop
does to the gradients between the backward and `optimizer.step()` (clipping by the global norm,
skipping a step on a bad loss) comes too late: the buckets have stepped. On GPUs it is refused
for now: NCCL's future completes when the all-reduce is queued, and the bucket step would need
to wait on its stream.
"""

from __future__ import annotations

import concurrent.futures
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic.comm.state_sync import RunState
from elastic.config import Strategy
from elastic.errors import ElasticError
from elastic.techniques.technique import Run, Technique


class OptimizerOverlap(Technique):
    """The run's optimizer, stepped per gradient bucket by one thread."""

    hooks_gradients = True  # `after_reduce` runs in the hook
    steps_on_bucket_views = True

    def __init__(self) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._group_of: dict[torch.Tensor, int] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="elastic-overlap")
        self._lock = threading.Lock()
        self._round = 0  # bumped by a rollback: a bucket of the failed step that lands later is not stepped
        self._pending: list[Future] = []
        self._stepped: set[torch.Tensor] = set()  # this step's parameters stepped by their buckets
        self._saved: list[tuple[list[torch.Tensor], list[dict[str, Any]]]] = []  # this step's, in stepping order
        self._copies: dict[tuple[torch.Tensor, str], torch.Tensor] = {}  # reused from step to step

    @classmethod
    def build(cls, strategy: Strategy, run: Run) -> OptimizerOverlap | None:
        return cls() if strategy.overlap_optimizer else None

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, state: RunState) -> torch.optim.Optimizer:
        self.adopt(optimizer)
        return optimizer

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """From now on `optimizer.step()` waits for the buckets' steps and steps only the rest."""
        self._optimizer = optimizer
        own_step = optimizer.step

        def step(bound: torch.optim.Optimizer, closure: Any = None) -> Any:
            if closure is not None:
                raise ElasticError("optimizer.step(closure) under Strategy(overlap_optimizer=True): the buckets "
                                   "stepped as the backward's all-reduces landed, so a closure's second backward "
                                   "would step them again; call optimizer.step() without one")
            self.wait()
            stepped = self._stepped
            # The parameters no bucket carried (none at all outside a generation, or ones the
            # optimizer holds beyond the prepared model) step here; the hooks run as always.
            return _step_over(bound, [dict(group, params=[p for p in group["params"] if p not in stepped])
                                      for group in bound.param_groups], own_step)

        # A bound method, as LR schedulers expect of `optimizer.step`.
        optimizer.step = types.MethodType(step, optimizer)

    def after_reduce(self, future: torch.futures.Future, bucket: dist.GradBucket) -> torch.futures.Future:
        """Chain onto a bucket's all-reduce: once it lands, queue the step of its parameters."""
        if self._optimizer is None:
            return future  # no optimizer prepared: nothing to step
        round_ = self._round

        def landed(done: torch.futures.Future) -> torch.Tensor:
            averaged, buffer = done.value(), bucket.buffer()  # value() raises a failed all-reduce to DDP
            if averaged.data_ptr() != buffer.data_ptr():
                buffer.copy_(averaged)  # the parameters' gradients are views of the buffer
            params = bucket.parameters()
            with self._lock:
                if round_ == self._round:
                    self._pending.append(self._executor.submit(self._step_bucket, params, round_))
            return buffer

        return future.then(landed)

    def wait(self) -> None:
        """Wait for every bucket step queued so far; then raise the first that failed."""
        with self._lock:
            pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)
        for future in pending:
            future.result()

    def committed(self) -> None:
        """The step committed (its `optimizer.step()` waited already, unless the loop skipped it)."""
        self.wait()
        self._saved, self._stepped = [], set()

    def failed(self) -> None:
        self.roll_back()

    def roll_back(self) -> None:
        """The step failed: stop stepping its buckets and put back those that stepped."""
        with self._lock:
            self._round += 1
            pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)  # a bucket that failed to step is put back like the others
        with torch.no_grad():
            for params, states in reversed(self._saved):
                for param, state in zip(params, states):
                    param.copy_(self._copies[(param, "param")])
                    if not state:
                        self._optimizer.state.pop(param, None)
                        continue
                    self._optimizer.state[param] = {key: self._copies[(param, key)].clone()
                                                    if isinstance(value, torch.Tensor) else value
                                                    for key, value in state.items()}
        self._saved, self._stepped = [], set()

    def _step_bucket(self, params: list[torch.Tensor], round_: int) -> None:
        optimizer = self._optimizer
        if round_ != self._round:
            return
        # A parameter the optimizer does not hold is left alone, as the optimizer's own step would.
        members: dict[int, list[torch.Tensor]] = {}
        for param in params:
            group = self._group(param)
            if group is not None:
                members.setdefault(group, []).append(param)
        params = [param for group in sorted(members) for param in members[group]]
        with torch.no_grad():
            states = []
            for param in params:
                self._copy(param, "param", param)
                state = dict(optimizer.state.get(param, {}))
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        self._copy(param, key, value)
                states.append(state)
        self._saved.append((params, states))
        self._stepped.update(params)
        groups = optimizer.param_groups
        # The optimizer's own step, without its hooks, over the bucket's parameters only.
        _step_over(optimizer, [dict(groups[i], params=ps) for i, ps in sorted(members.items())],
                   lambda: type(optimizer).step.__wrapped__(optimizer))

    def _group(self, param: torch.Tensor) -> int | None:
        group = self._group_of.get(param)
        if group is None:
            self._group_of = {p: i for i, g in enumerate(self._optimizer.param_groups) for p in g["params"]}
            group = self._group_of.get(param)
        return group

    def _copy(self, param: torch.Tensor, key: str, value: torch.Tensor) -> None:
        copy = self._copies.get((param, key))
        if copy is None or copy.shape != value.shape or copy.dtype != value.dtype:
            self._copies[(param, key)] = value.detach().clone()
        else:
            copy.copy_(value)


def _step_over(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], step: Callable[[], Any]) -> Any:
    """`step()` with the optimizer's param groups narrowed to `groups` (each a copy of one of its
    groups with fewer parameters), and its own groups put back after."""
    whole = optimizer.param_groups
    optimizer.param_groups = groups
    try:
        return step()
    finally:
        optimizer.param_groups = whole
