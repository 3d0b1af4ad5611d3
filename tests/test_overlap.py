"""The optimizer stepped bucket by bucket as DDP's all-reduces land (`OptimizerOverlap`), in real
gloo processes without Ray: it computes the optimizer's own step over the whole model (two param
groups, an LR schedule made after it was adopted, a parameter no bucket carries), and a step
that fails after some buckets stepped is put back exactly, parameters and optimizer state."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic import Fault, ScalingConfig, Strategy
from elastic.comm.group import GradientAllReduce
from elastic.techniques.overlap import OptimizerOverlap
from gloo_processes import client, join, spawn
from test_techniques import MAX_STEPS, SLOW_STEP_S, _assert_exactly_once, _fit, _max_diff
from workloads import OutsideKiller, regression_reference

pytestmark = pytest.mark.timeout(120)
WORLD_SIZE = 2
STEPS = 5
FAILED_STEP = 3  # its second bucket's all-reduce is aborted, after the first bucket stepped
BUCKET_CAP_MB = 0.01  # several buckets for a small model


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1)).double()


def _extra() -> torch.nn.Parameter:
    """A parameter the optimizer holds beyond the DDP model, in a loss term alike on every rank:
    no bucket carries it, so `optimizer.step()` steps it itself."""
    return torch.nn.Parameter(torch.ones(3, dtype=torch.float64))


def _optimizer(model: torch.nn.Module, extra: torch.nn.Parameter) -> torch.optim.Optimizer:
    # Two groups with different hyperparameters: a bucket's step must keep each parameter's own.
    first, *rest = model.parameters()
    return torch.optim.AdamW([{"params": [first], "lr": 0.01},
                              {"params": [*rest, extra], "lr": 0.03, "weight_decay": 0.1}])


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _loss(output: torch.Tensor, target: torch.Tensor, extra: torch.nn.Parameter) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target) + 0.1 * (extra ** 2).sum()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(8 * WORLD_SIZE, 8, generator=generator, dtype=torch.float64),
            torch.randn(8 * WORLD_SIZE, 1, generator=generator, dtype=torch.float64))


def _state(model, optimizer, extra) -> dict:
    return {"params": {**{k: v.detach().clone() for k, v in model.state_dict().items()}, "extra": extra.detach().clone()},
            "optimizer": copy.deepcopy(optimizer.state_dict()["state"])}


def _reference() -> dict:
    model, extra = _model(), _extra()
    optimizer = _optimizer(model, extra)
    schedule = _schedule(optimizer)
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model(x), y, extra).backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return _state(model, optimizer, extra)


def _member(rank, port, results):
    store = client(port)
    join(store, 0, rank, WORLD_SIZE)
    module, extra = _model(), _extra()
    optimizer = _optimizer(module, extra)
    overlap = OptimizerOverlap()
    overlap.adopt(optimizer)
    schedule = _schedule(optimizer)  # made after adopt, as a train loop makes it after prepare_optimizer
    collectives = GradientAllReduce(generation=0, abortable=True)
    buckets, step_now, before_failed, partial = {}, [0], None, None

    def hook(_, bucket):
        if step_now[0] == FAILED_STEP and bucket.index() == 1:
            buckets[0].wait()  # the first bucket landed (and its step is queued) ...
            collectives.abort("a peer is gone")  # ... then the heal's offer aborts the generation's all-reduces
        buffer = bucket.buffer().div_(WORLD_SIZE)
        landed = buckets[bucket.index()] = overlap.after_reduce(collectives.all_reduce(buffer), bucket)
        return landed

    ddp = DistributedDataParallel(module, gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(None, hook)
    step = 0
    while step < STEPS:
        step_now[0] = step
        x, y = _batch(step)
        share = slice(rank * 8, (rank + 1) * 8)
        if step == FAILED_STEP and before_failed is None:
            before_failed = _state(module, optimizer, extra)
        try:
            _loss(ddp(x[share]), y[share], extra).backward()
        except RuntimeError:
            overlap.wait()  # the first bucket's step has run
            partial = _state(module, optimizer, extra)
            optimizer.zero_grad(set_to_none=True)
            overlap.roll_back()
            # The heal: a new generation's all-reduce and DDP, and the step redone.
            collectives = GradientAllReduce(generation=1, abortable=True)
            ddp = DistributedDataParallel(module, gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_CAP_MB)
            ddp.register_comm_hook(None, hook)
            step_now[0] = -1
            results[f"rolled_back/{rank}"] = _state(module, optimizer, extra)
            continue
        optimizer.step()
        overlap.committed()
        optimizer.zero_grad()
        schedule.step()
        step += 1
    results[rank] = {"buckets": len(buckets), "before_failed": before_failed, "partial": partial,
                     "final": _state(module, optimizer, extra)}
    dist.destroy_process_group()


def _state_diff(a: dict, b: dict) -> float:
    if isinstance(a, torch.Tensor):
        return (a - b).abs().max().item() if a.is_floating_point() else float((a != b).any())
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max((_state_diff(a[k], b[k]) for k in a), default=0.0)
    return 0.0 if a == b else float("inf")


def test_bucket_by_bucket_steps_equal_the_optimizer_and_a_half_stepped_failure_is_put_back_exactly():
    results = spawn(_member, nprocs=WORLD_SIZE)
    reference = _reference()
    for rank in range(WORLD_SIZE):
        run = results[rank]
        assert run["buckets"] >= 2, f"the premise: the model's gradients travel in several buckets ({run['buckets']})"
        # The failed step's first bucket stepped its parameters before the second failed ...
        assert _state_diff(run["partial"]["params"], run["before_failed"]["params"]) > 1e-6
        # ... and the rollback put back the parameters and AdamW's state to the step's start.
        assert _state_diff(results[f"rolled_back/{rank}"], run["before_failed"]) == 0.0
        assert _state_diff(run["final"]["params"], reference["params"]) < 1e-12
        assert _state_diff(run["final"]["optimizer"], reference["optimizer"]) < 1e-12


# --- through Ray: heals of the runs of `test_techniques` ----------------------------------------

HIDDEN = 16384  # a first layer of 2 MB in float64: its gradient travels in a bucket of its own


KILL_RUN_STEPS = 14  # the kill at step 9, the heal and a few steps at the healed size: the 2 MB layer makes each step slow


def test_an_overlapped_adamw_run_heals_a_death_in_its_all_reduce_and_equals_ddp(local_ray, tmp_path):
    result = _fit(tmp_path, "overlap-kill", ScalingConfig(min_workers=2, max_workers=3),
                  Strategy(overlap_optimizer=True), faults=[Fault(kind="kill", rank=1, step=9, where="allreduce")],
                  max_steps=KILL_RUN_STEPS, optimizer="adamw", hidden=HIDDEN)
    assert result.events_of("recovery"), "no heal"
    reference = regression_reference(KILL_RUN_STEPS, seed=0, optimizer="adamw", hidden=HIDDEN)["params"]
    assert _max_diff(result.value["params"], reference) < 1e-9
    _assert_exactly_once(result.value["ledger"], KILL_RUN_STEPS)


# Under `-m soak` (the suite's time on 2 cores): CI heals an overlapped run through the Fault kill
# above, and has a slow-step outside SIGKILL through the chaos matrix (a newcomer's, inside a 0.25 s step).
@pytest.mark.soak
def test_an_overlapped_run_heals_a_sigkill_from_outside_inside_a_slow_step_and_equals_ddp(local_ray, tmp_path):
    killer = OutsideKiller("mid-step", str(tmp_path), "overlap-sigkill", SimpleNamespace(compute_s=SLOW_STEP_S), seed=5)
    killer.start()
    result = _fit(tmp_path, "overlap-sigkill", ScalingConfig(min_workers=2, max_workers=3),
                  Strategy(overlap_optimizer=True), compute_s=SLOW_STEP_S)
    assert killer.done.wait(60) and killer.killed, "the outside kill never happened"
    assert result.events_of("recovery"), "no heal"
    assert _max_diff(result.value["params"], regression_reference(MAX_STEPS, seed=0)["params"]) < 1e-9
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)
