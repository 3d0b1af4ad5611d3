"""The optimizer stepped bucket by bucket as DDP's all-reduces land (`Strategy(overlap_optimizer=True)`).

Plain DDP overlaps the gradient all-reduce with the backward pass only; the optimizer waits for
the last bucket, then steps over every parameter. Over a link slower than compute the step is
then forward + all-reduce + optimizer. Here each bucket's parameters are stepped, on a thread of
their own, as soon as that bucket's all-reduce returns, while the next buckets are still on the
wire: the step becomes forward + all-reduce + the last bucket's share of the optimizer (torch's
`_hook_then_optimizer` does this for its functional optimizers; this one steps the run's own
optimizer, whose state heals and checkpoints as before).

What the train loop sees: `optimizer.step()` waits for the buckets' steps, then runs the
optimizer's hooks over an empty step (so the step still commits where it did). Gradients are
DDP's bucket views (`gradient_as_bucket_view`), so a bucket's parameters read the averaged
gradient the moment its all-reduce lands.

Exact, and rolled back like any failed step: before a bucket's parameters are stepped, they and
their optimizer state are copied; a step that fails after some buckets stepped (a peer died in a
later all-reduce) copies them back, so every rank is at the step's start again. The copies cost
one extra pass over the parameters and the optimizer state per step, on the same thread, while
the link is busy.

Correct for optimizers that update each parameter from its own gradient and state (SGD, Adam,
AdamW, RMSprop...). Anything the loop does to the gradients between the backward and
`optimizer.step()` (clipping by the global norm, say) comes too late: the buckets have stepped.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist


class OptimizerOverlap:
    """The run's optimizer, stepped per gradient bucket by one thread."""

    def __init__(self) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._group_of: dict[torch.Tensor, int] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="elastic-overlap")
        self._lock = threading.Lock()
        self._round = 0  # bumped by a rollback: a bucket of the failed step that lands later is not stepped
        self._pending: list[Future] = []
        self._saved: list[tuple[list[torch.Tensor], list[dict[str, Any]]]] = []  # this step's, in stepping order
        self._copies: dict[tuple[torch.Tensor, str], torch.Tensor] = {}  # reused from step to step

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """From now on `optimizer.step()` waits for the buckets' steps and steps nothing itself."""
        self._optimizer = optimizer
        own_step = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            stepped = self.wait()
            if not stepped:
                return own_step(*args, **kwargs)  # no bucket was reduced (outside a generation): a whole step
            groups = optimizer.param_groups
            optimizer.param_groups = []  # each bucket stepped its parameters; the hooks still run
            try:
                return own_step(*args, **kwargs)
            finally:
                optimizer.param_groups = groups

        optimizer.step = step

    def after_reduce(self, future: torch.futures.Future, bucket: dist.GradBucket) -> torch.futures.Future:
        """Chain onto a bucket's all-reduce: once it lands, queue the step of its parameters."""
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

    def wait(self) -> bool:
        """Wait for the buckets queued so far; True if any stepped. Raises the first that failed."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        return bool(pending)

    def committed(self) -> None:
        self._saved = []

    def roll_back(self) -> None:
        """The step failed: stop stepping its buckets and put back those that stepped."""
        with self._lock:
            self._round += 1
            pending, self._pending = self._pending, []
        for future in pending:
            future.exception()  # waits; a bucket that failed to step is put back like the others
        with torch.no_grad():
            for params, states in reversed(self._saved):
                for param, state in zip(params, states):
                    param.copy_(self._copies[(param, "param")])
                    self._optimizer.state[param] = {key: self._copies[(param, key)].clone()
                                                    if isinstance(value, torch.Tensor) else value
                                                    for key, value in state.items()}
        self._saved = []

    def _step_bucket(self, params: list[torch.Tensor], round_: int) -> None:
        optimizer = self._optimizer
        if round_ != self._round:
            return
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
        groups = optimizer.param_groups
        members: dict[int, list[torch.Tensor]] = {}
        for param in params:
            members.setdefault(self._group(param), []).append(param)
        optimizer.param_groups = [dict(groups[i], params=ps) for i, ps in sorted(members.items())]
        try:
            type(optimizer).step.__wrapped__(optimizer)  # the optimizer's own step, without its hooks
        finally:
            optimizer.param_groups = groups

    def _group(self, param: torch.Tensor) -> int:
        group = self._group_of.get(param)
        if group is None:
            self._group_of = {p: i for i, g in enumerate(self._optimizer.param_groups) for p in g["params"]}
            group = self._group_of[param]
        return group

    def _copy(self, param: torch.Tensor, key: str, value: torch.Tensor) -> None:
        copy = self._copies.get((param, key))
        if copy is None or copy.shape != value.shape or copy.dtype != value.dtype:
            self._copies[(param, key)] = value.detach().clone()
        else:
            copy.copy_(value)
