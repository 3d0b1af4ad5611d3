"""What keeps an NCCL survivor alive, checked where it can be without GPUs.

The watchdog mode must never tear the process down, and the control thread's abort of a
stale communicator (handed to the retirement thread, `elastic.comm.retirement`) must hit only
the generation it was meant for, once, never its replacement. The GPU paths themselves run in
tests/test_generations.py where CUDA exists, through `sh tests/gpu_check.sh` on a GPU machine.
"""

import os
import subprocess
import sys

import pytest

from elastic.comm.generation import GenerationGroup
from elastic.comm.group import NCCL_ERROR_HANDLING, NCCL_SURVIVOR_MODE, GradientAllReduce
from elastic.comm.links import GroupLinks
from elastic.comm.retirement import retirement
from elastic.config import DataConfig
from elastic.worker.context import TrainContext
from elastic.worker.mailbox import GenerationMailbox

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
