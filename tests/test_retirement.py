"""A heal does not wait for NCCL's abort of the stale communicator (no Ray).

`ncclCommAbort` lasts about a second (`elastic.comm.retirement`). Here a communicator whose abort
lasts until the test releases it stands for NCCL's, in the place a generation's world group takes
(`GenerationGroup.world`), while the groups the ranks form are real gloo groups in two processes.
Each rank does what a worker does in a heal: the control thread aborts the stale generation, the
train thread leaves it the way an NCCL worker does (`leave_group("nccl")`: every group out of
torch's registry and onto the retirement thread) and forms and trains the next generation. All of
it must finish while the stale abort is still under way, and that abort must still run, once.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic.comm.generation import GenerationGroup
from elastic.comm.group import (
    GenerationSpec, GradientAllReduce, forget_every_group, form_group, leave_group, rendezvous,
)
from elastic.comm.links import GroupLinks
from elastic.comm.retirement import Retirement, retirement
from gloo_processes import client, spawn

pytestmark = pytest.mark.timeout(120)


class HeldAbort:
    """A communicator whose abort lasts until `release` is set, as NCCL's joins its threads for a second."""

    def __init__(self, release: threading.Event, log: list[str] | None = None, name: str = "") -> None:
        self.release, self.log, self.name = release, log if log is not None else [], name
        self.aborts = 0

    def abort(self) -> None:
        self.log.append(f"{self.name} began")
        self.release.wait()
        self.aborts += 1
        self.log.append(f"{self.name} ended")


def _spec(generation, rank, port, world_size=2):
    return GenerationSpec(generation=generation, rank=rank, world_size=world_size, local_rank=rank,
                          local_world_size=world_size, node_rank=0, store_host="127.0.0.1", store_port=port,
                          backend="gloo", reason="heal", collective_timeout_s=60)


def _form_and_sum(spec, store):
    assert rendezvous(spec, store)
    form_group(spec, store)
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def _healing_rank(rank, port, results):
    store = client(port)
    _form_and_sum(_spec(0, rank, port), store)
    release = threading.Event()
    communicator = HeldAbort(release)
    stale = GenerationGroup(0, "nccl", communicator, GroupLinks(frozenset()), GradientAllReduce(0, abortable=False))
    stale.abort("the controller offered generation 1")  # the control thread, at the heal's offer
    leave_group("nccl")  # the train thread
    trained = _form_and_sum(_spec(1, rank, port), store)
    still_aborting = communicator.aborts == 0 and not retirement.wait_idle(0)
    release.set()
    idle = retirement.wait_idle(30)
    again = torch.ones(1)
    dist.all_reduce(again)  # the retirement let go of generation 0's groups, not of generation 1's
    leave_group("gloo")
    results[rank] = {"trained": trained, "still_aborting": still_aborting, "idle": idle,
                     "aborts": communicator.aborts, "again": again.item(), "error": stale.errored()}


def test_a_heal_forms_and_trains_the_next_generation_while_the_stale_communicator_is_still_aborting():
    results = spawn(_healing_rank, nprocs=2)
    for rank in (0, 1):
        assert results[rank] == {"trained": 2.0, "still_aborting": True, "idle": True, "aborts": 1, "again": 2.0,
                                 "error": "the controller offered generation 1"}, results


def test_aborts_run_one_batch_after_another_never_two_at_once_the_control_threads_before_those_queued():
    release, log = threading.Event(), []
    retiring = Retirement()
    retiring.retire([HeldAbort(release, log, "first")])
    while not log:  # the first batch is under way
        time.sleep(0.001)
    retiring.retire([HeldAbort(release, log, "queued")])
    retiring.retire([HeldAbort(release, log, "urgent")], urgent=True)
    threading.Timer(0.2, release.set).start()  # time enough for a second abort to begin, if it could
    assert retiring.wait_idle(30)
    assert log == ["first began", "first ended", "urgent began", "urgent ended", "queued began", "queued ended"]
    assert len(retiring.seconds) == 3


def _registries():
    """How much torch's registry of process groups holds, attribute by attribute."""
    world = dist.distributed_c10d._world
    values = dict(vars(world))
    for name, attribute in vars(type(world)).items():
        if isinstance(attribute, property):
            try:
                values[name] = getattr(world, name)
            except ValueError:
                pass  # computed from the default group, which neither registry has any more
    held = {name: len(value) for name, value in values.items() if isinstance(value, (dict, list, set))}
    return held, world.group_count, dist.is_initialized()


def _forgetting_rank(rank, port, results):
    store = client(port)
    spec = _spec(0, rank, port, world_size=1)
    form_group(spec, store)
    dist.new_group([0]), dist.new_group([0])
    dist.distributed_c10d._abort_process_group()
    aborted = _registries()
    form_group(_spec(1, rank, port, world_size=1), store)
    default = dist.group.WORLD
    subgroups = [dist.new_group([0]), dist.new_group([0])]
    groups = forget_every_group()
    order = [default, *reversed(subgroups)] == groups  # the same on every rank: the default group first
    forgotten = _registries()
    form_group(_spec(2, rank, port, world_size=1), store)
    total = torch.ones(1)
    dist.all_reduce(total)
    old = torch.ones(1)
    dist.all_reduce(old, group=default)  # forgotten, not aborted: the old default group still works
    results[rank] = {"same": forgotten == aborted, "forgotten": forgotten, "aborted": aborted, "order": order,
                     "groups": len(groups), "name": dist.group.WORLD.group_name, "sums": (total.item(), old.item())}
    leave_group("gloo", groups)


def test_forgetting_every_group_clears_what_torchs_abort_clears_and_aborts_nothing():
    result = spawn(_forgetting_rank, nprocs=1)[0]
    assert result["same"], result
    assert result["forgotten"][2] is False
    assert (result["groups"], result["order"], result["name"], result["sums"]) == (3, True, "0", (1.0, 1.0)), result
