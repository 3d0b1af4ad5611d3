"""Chaos: seeded random fault schedules, and at the end nothing is lost.

Each run draws its faults (kills at step start and mid all-reduce, hangs, crashes while
writing a checkpoint, controller deaths, application errors) from a seeded generator and
trains to the end. Then it must hold that: the run completed; the per-sample ledger counts
every sample of every epoch exactly once; the parameters equal those of one process training
each step's whole global batch within 1e-9 (float64); every checkpoint with a manifest
verifies; goodput is reported.

    pytest tests/test_chaos.py                 # the short form, 1 run x 6 faults (one of each kind), in CI
    pytest -m soak tests/test_chaos.py         # 3 more short seeds and the long soak, 20 more
"""

import random

import pytest
import torch

from elastic import CheckpointConfig, DataConfig, ElasticTrainer, FailureConfig, Fault, RunConfig, ScalingConfig
from elastic.checkpoint.checkpoint import checkpoint_steps, checkpoint_storage, step_dir, verify
from elastic.checkpoint.storage import RunStorage
from workloads import GLOBAL_BATCH, STEPS_PER_EPOCH, regression_loop, regression_reference

MAX_STEPS = 14 * STEPS_PER_EPOCH
FAULT_SLOTS = range(16, MAX_STEPS, 16)  # six checkpoint steps (every 8), a few seconds apart: one per kind
CHECKPOINT_EVERY = 8
PARAM_TOLERANCE = 1e-9
DATA_SEED = 11
# Every seed draws every kind once (six slots, six kinds); seed 0 runs in CI, 1 to 3 under
# -m soak, for the suite's time on 2 cores.
CI_SEEDS = [0]
SHORT_SEEDS = CI_SEEDS + [pytest.param(seed, marks=pytest.mark.soak) for seed in (1, 2, 3)]
SOAK_SEEDS = list(range(100, 120))


KINDS = ("kill", "kill-allreduce", "hang", "checkpoint-crash", "controller-kill", "raise")


def draw_faults(seed: int) -> list[Fault]:
    """One fault per slot, all on rank 0, which exists at every world size, so every one fires.

    The kinds are a seeded shuffle that starts where the seed says, so consecutive seeds
    together cover every kind.
    """
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, len(KINDS))
    faults = []
    for slot, step in enumerate(FAULT_SLOTS):
        kind = kinds[(seed + slot) % len(kinds)]
        rank = 0
        if kind == "kill-allreduce":
            faults.append(Fault(kind="kill", rank=rank, step=step, where="allreduce"))
        elif kind == "controller-kill":
            faults.append(Fault(kind="controller-kill", step=step))
        else:
            faults.append(Fault(kind=kind, rank=rank, step=step))
    return faults


def _trainer(storage_path, name, workers, faults=()):
    return ElasticTrainer(
        regression_loop,
        train_loop_config={"max_steps": MAX_STEPS, "sleep_s": 0.03},
        scaling_config=ScalingConfig(min_workers=workers[0], max_workers=workers[1]),
        run_config=RunConfig(
            name=name, storage_path=str(storage_path),
            checkpoint_config=CheckpointConfig(every_steps=CHECKPOINT_EVERY, keep_last=3),
            failure_config=FailureConfig(max_failures=len(FAULT_SLOTS), hang_floor_s=1.0, hang_factor=10),
        ),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=16, max_steps=MAX_STEPS, seed=DATA_SEED),
        faults=list(faults),
        show_progress=False,
    )


@pytest.fixture(scope="module")
def reference():
    return regression_reference(MAX_STEPS, seed=DATA_SEED)


def _chaos_run(reference, tmp_path, seed):
    faults = draw_faults(seed)
    result = _trainer(tmp_path, f"chaos-{seed}", (1, 2), faults).fit()
    fired = result.events_of("fault_injected")
    assert result.step == MAX_STEPS
    ledger = result.value["ledger"]
    assert torch.equal(ledger, torch.ones_like(ledger)), f"seed {seed}: a sample was lost or seen twice"
    for name, value in reference["params"].items():
        difference = (result.value["params"][name] - value).abs().max().item()
        assert difference < PARAM_TOLERANCE, f"seed {seed}: {name} differs by {difference}"
    run = RunStorage(str(tmp_path), f"chaos-{seed}")
    for step in checkpoint_steps(run):
        if run.size(f"{step_dir(step)}/manifest.json") is not None:
            verify(checkpoint_storage(run, step))
    assert 0 < result.goodput <= 1
    assert sorted(e["fault"] for e in fired) == sorted(f.spec() for f in faults), f"seed {seed}: a fault never fired"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SHORT_SEEDS)
def test_nothing_is_lost_under_a_seeded_fault_schedule(local_ray, reference, tmp_path, seed):
    _chaos_run(reference, tmp_path, seed)


@pytest.mark.soak
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SOAK_SEEDS)
def test_nothing_is_lost_in_the_long_soak(local_ray, reference, tmp_path, seed):
    _chaos_run(reference, tmp_path, seed)


@pytest.mark.parametrize("seed", [*CI_SEEDS, *SOAK_SEEDS])
def test_every_schedule_holds_a_fault_of_every_kind(seed):
    kinds = [f.kind if f.where == "step_start" else f"{f.kind}-{f.where}" for f in draw_faults(seed)]
    assert sorted(kinds) == sorted(("kill", "kill-allreduce", "hang", "checkpoint-crash", "controller-kill", "raise"))
