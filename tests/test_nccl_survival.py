"""What keeps an NCCL survivor alive, checked where it can be without GPUs.

The watchdog mode must never tear the process down, and the control thread's abort of a
stale communicator (handed to the retirement thread, `elastic.comm.retirement`) must hit only
the generation it was meant for, once, never its replacement. A rank's wait for NCCL's
collectives to land (`GenerationGroup.wait_landed`) latches the generation when their sum falls
short, and what waits on it (a step that commits without the optimizer's step, a between-steps
block) fails and heals instead of using what they wrote; stand-ins take the communicator's and
its sum's place. The GPU paths themselves run in tests/test_generations.py and
tests/test_nccl_landing.py where CUDA exists, through `sh tests/gpu_check.sh` on a GPU machine.
"""

import os
import subprocess
import sys

import pytest

from elastic.comm import generation as generations
from elastic.comm.generation import GenerationGroup, peer_failed
from elastic.comm.group import NCCL_ERROR_HANDLING, NCCL_SURVIVOR_MODE, GenerationSpec, GradientAllReduce
from elastic.comm.links import GroupLinks
from elastic.comm.retirement import retirement
from elastic.config import DataConfig
from elastic.worker.context import TrainContext
from elastic.worker.mailbox import GenerationMailbox
from elastic.worker.step import BetweenSteps, Step

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("inherited", ["1", "3", ""])
def test_the_nccl_watchdog_never_tears_a_survivor_down(inherited):
    env = {**os.environ, NCCL_ERROR_HANDLING: inherited}
    code = f"import elastic.comm.group, os; print(os.environ[{NCCL_ERROR_HANDLING!r}])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == NCCL_SURVIVOR_MODE == "2"


def test_a_stale_abort_hits_the_captured_group_and_never_the_one_that_replaced_it():
    aborted = []
    ctx = TrainContext(DataConfig(global_batch_size=4, micro_batch_size=2, max_steps=1), GenerationMailbox(), [],
                       lambda report: None, use_gpu=False)
    old, new = _Communicator("old", aborted), _Communicator("new", aborted)
    ctx.membership._group = _generation(3, old)
    ctx.abort_stale_group(3)
    assert retirement.wait_idle(30)
    assert aborted == [], "the current generation was aborted by an offer of itself"
    ctx.abort_stale_group(4)
    ctx.abort_stale_group(5)  # a second offer: the group was handed over at the first
    assert retirement.wait_idle(30)
    assert aborted == ["old"]
    ctx.membership._group = _generation(4, new)  # the train thread formed generation 4 meanwhile
    ctx.abort_stale_group(4)
    assert retirement.wait_idle(30)
    assert aborted == ["old"], "the replacement group was aborted"


class _Communicator:
    """Stands for an NCCL group (none exists without a GPU): it records its aborts."""

    def __init__(self, name, aborted):
        self.name, self.aborted = name, aborted

    def abort(self):
        self.aborted.append(self.name)


def _generation(number, world):
    return GenerationGroup(number, "nccl", world, GroupLinks(frozenset()), GradientAllReduce(number, abortable=False))


class _World:
    """Stands for an NCCL world group of `size` ranks (none exists without a GPU)."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


class _Sum:
    """Stands for the landing all-reduce's sum on the GPU: what NCCL left of it."""

    def __init__(self, total):
        self.total, self.queued = total, 0

    def sum_after(self, group):
        self.queued += 1
        return self.total


def _landing_generation(total, world_size=2):
    group = _generation(7, _World(world_size))
    group._landing = _Sum(total)
    return group


def test_nccl_collectives_that_landed_pass_and_a_short_sum_latches_the_generation_as_a_peer_failure():
    landed = _landing_generation(2.0)
    landed.wait_landed()
    assert landed.errored() is None
    broken = _landing_generation(1.0)
    with pytest.raises(RuntimeError) as raised:
        broken.wait_landed()
    assert "summed 1 of 2" in broken.errored()
    generations.enter(broken)
    try:
        assert peer_failed(raised.value)
        # Latched: a later wait queues no collective on a communicator that may be under abort.
        with pytest.raises(RuntimeError):
            broken.wait_landed()
        assert broken._landing.queued == 1
    finally:
        generations.enter(None)


def test_a_group_of_one_and_gloo_wait_for_nothing():
    alone = _landing_generation(0.0, world_size=1)
    alone.wait_landed()
    gloo = GenerationGroup(7, "gloo", _World(2), GroupLinks(frozenset()), GradientAllReduce(7, abortable=False))
    gloo._landing = _Sum(0.0)
    gloo.wait_landed()
    assert alone._landing.queued == gloo._landing.queued == 0


def test_a_between_steps_block_whose_nccl_collectives_did_not_land_fails_and_heals_instead_of_reading_them():
    healed = []
    generations.enter(_landing_generation(1.0))
    try:
        with BetweenSteps(lambda: healed.append(True)) as block:
            pass  # the loop's all-reduce was queued here; its sum would be read after the block
    finally:
        generations.enter(None)
    assert block.failed is not None and "did not complete" in block.failed and healed == [True]


def test_a_step_that_commits_without_an_optimizer_step_fails_when_its_nccl_collectives_did_not_land():
    ctx = TrainContext(DataConfig(global_batch_size=4, micro_batch_size=2, max_steps=2), GenerationMailbox(), [],
                       lambda report: None, use_gpu=False)
    spec = GenerationSpec(generation=7, rank=0, world_size=2, local_rank=0, local_world_size=2, node_rank=0,
                          store_host="127.0.0.1", store_port=1, backend="nccl", reason="test", collective_timeout_s=60)
    step = Step(ctx, spec, 0, ctx._progress.cursor, 4)
    generations.enter(_landing_generation(1.0))
    try:
        swallowed = ctx.stepping.end(step, None)
    finally:
        generations.enter(None)
    assert swallowed and step.failed is not None and not step.committed
    assert ctx.step == 0, "the step committed on collectives that did not land"
