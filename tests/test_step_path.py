"""The path of one steady DDP step through elastic's modules, counted in calls rather than timed.

One process trains a real `TrainContext` over a gloo group of world size 1 (no Ray; the test
makes the controller's offer, as benchmarks/step_overhead.py does), with the loop of the
README: `ctx.steps`, `with step`, `step.micro_batches()`, `mb.backward`, the prepared
optimizer's `step()` and `zero_grad()`. Past the warm-up, one step runs under `sys.setprofile`,
from the loop's request for the step to the step's end (elastic's work between two steps
included), and every call from a module of `elastic` into another module of `elastic` is
counted: a call inside one module, a call from torch or the loop into elastic, and torch's
own work are not. docs/architecture.md ("A step's path") gives the figure and what it counts.
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch

from gloo_processes import spawn

pytestmark = pytest.mark.timeout(120)

# The calls between elastic's modules in one steady step, as counted below (45 before issue 41
# part 3, 38 after, 35 once the per-step hooks went only to the techniques that act there): a step
# that goes through more of elastic's modules than this fails the test; a change that shortens the
# path lowers it, with the figure in docs/architecture.md.
STEP_PATH_BOUND = 35
WARM_STEPS = 3  # the first forms the generation; the next ones settle the loader's and DDP's first-use paths


def _caller_and_callee(frame) -> tuple[str, str] | None:
    """(the calling module, the callee as module.function) of a call between two modules of elastic."""
    callee = frame.f_globals.get("__name__", "")
    caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
    if callee.startswith("elastic.") and caller.startswith("elastic.") and caller != callee:
        return caller, f"{callee}.{frame.f_code.co_qualname}"
    return None


def _count_one_step(process, port, results) -> None:
    from elastic.comm.group import GenerationSpec
    from elastic.config import DataConfig
    from elastic.worker.context import TrainContext
    from elastic.worker.mailbox import GenerationMailbox

    torch.manual_seed(0)
    mailbox = GenerationMailbox()
    ctx = TrainContext(DataConfig(global_batch_size=8, micro_batch_size=8, max_steps=WARM_STEPS + 2), mailbox, [],
                       lambda report: None, use_gpu=False)
    model = ctx.prepare_model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mailbox.offer(GenerationSpec(generation=0, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                                 store_host="127.0.0.1", store_port=port, backend="gloo", reason="start",
                                 collective_timeout_s=60))
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    steps = iter(ctx.steps(dataset))

    def one_step() -> None:
        step = next(steps)
        with step:
            for mb in step.micro_batches():
                x, y = mb.data
                mb.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    for _ in range(WARM_STEPS):
        one_step()
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg) -> None:
        if event == "call" and (edge := _caller_and_callee(frame)) is not None:
            calls[edge] += 1

    sys.setprofile(profile)
    try:
        one_step()
    finally:
        sys.setprofile(None)
    results["calls"] = dict(calls)
    results["committed"] = ctx.step
    ctx.close()


def test_one_steady_ddp_step_crosses_between_elastics_modules_at_most_the_stated_number_of_times():
    results = spawn(_count_one_step, nprocs=1)
    assert results["committed"] == WARM_STEPS + 1, "the traced step did not commit"
    calls = collections.Counter(results["calls"])
    total = sum(calls.values())
    path = "\n".join(f"{count:3d}  {caller} -> {callee}" for (caller, callee), count in calls.most_common())
    assert total <= STEP_PATH_BOUND, (
        f"one steady DDP step makes {total} calls between elastic's modules, over the bound of {STEP_PATH_BOUND}; "
        f"shorten the path, or raise the bound and the figure in docs/architecture.md with the reason:\n{path}")
    print(f"{total} calls between elastic's modules in one steady DDP step:\n{path}")
