"""The controller's store forgets every generation older than the one that committed.

No Ray. A commit makes the protocol forget every older generation offered (`Forget`); the
controller then deletes what each left in its TCPStore (`forget_generation`): the barrier's keys
and the address gloo's connect wrote for each rank. Against a real TCPStore, 200 formations
(heals, aborted heals, grows) leave no more keys than the newest generation holds; and a real gloo
group in two processes shows that the keys named are the keys torch writes.
"""

import concurrent.futures
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.comm.group import (
    GenerationSpec, abort_generation, forget_generation, form_group, generation_keys, leave_group, rendezvous,
)
from elastic.controller.fake_group import FakeWorkerGroup
from elastic.controller.protocol import Status
from elastic.controller.signals import Abort, Forget, Offer
from gloo_processes import START_METHOD

pytestmark = pytest.mark.timeout(120)

MAX_WORKERS = 4
FORMATIONS = 200


def test_a_commit_forgets_every_older_generation_offered_aborted_or_not_and_keeps_its_own():
    group = FakeWorkerGroup(min_workers=1, max_workers=3)
    group.start_run(0, 1, 2)
    group.die(1)  # offers generation 1 to (0, 2)
    group.die(2)  # aborts it, offers generation 2 to (0,)
    group.form()
    assert [a for a in group.actions if isinstance(a, Forget)] == [Forget(((0, 3), (1, 2)))]
    group.ready(3)  # a grow: generation 3
    group.answer_prepare({0: 5})
    group.form()
    assert [a for a in group.actions if isinstance(a, Forget)][-1] == Forget(((2, 1),))


def _spec(generation, rank, world_size):
    return GenerationSpec(generation=generation, rank=rank, world_size=world_size, local_rank=0, local_world_size=1,
                          node_rank=rank, store_host="127.0.0.1", store_port=0, backend="gloo", reason="heal",
                          collective_timeout_s=10.0)


class StoreSide:
    """Carries the protocol's store actions out on a real TCPStore: each member arrives at the
    barrier on a connection of its own (as each worker has one) and, after a "go", writes its
    address where gloo's connect would: under c10d's prefixes of the default group ("0/", then
    "cpu/") and gloo's of its first device ("0"), keyed by its rank."""

    def __init__(self):
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.members = [dist.TCPStore("127.0.0.1", self.store.port, is_master=False, wait_for_workers=False)
                        for _ in range(MAX_WORKERS + 1)]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_WORKERS + 1)
        self.size_of = {}  # generation -> its world size, from its offer
        self.pending = {}  # generation -> the members' barrier calls

    def arrive(self, generation, members):
        """`members` (ranks of the generation) arrive at its barrier; the others have not yet."""
        size = self.size_of[generation]
        self.pending[generation] = [self.pool.submit(self._member, generation, rank, size) for rank in members]

    def _member(self, generation, rank, size):
        client = self.members[rank]
        if not rendezvous(_spec(generation, rank, size), client):
            return False
        gloo = dist.PrefixStore("0", dist.PrefixStore("cpu/", dist.PrefixStore("0/", dist.PrefixStore(
            f"generation/{generation}/group", client))))
        gloo.set(str(rank), b"\0" * 8 * size)  # a pair id per peer, about
        return True

    def carry(self, actions):
        for action in actions:
            if isinstance(action, Offer):
                self.size_of[action.formation.generation] = len(action.formation.members)
            elif isinstance(action, Abort):
                abort_generation(self.store, action.generation)
            elif isinstance(action, Forget):
                for generation, size in action.generations:
                    forget_generation(self.store, generation, size, "gloo")

    def outcomes(self, generation):
        return [call.result(timeout=30) for call in self.pending.pop(generation)]


def test_two_hundred_formations_leave_no_more_keys_in_the_store_than_the_newest_generation_holds():
    side = StoreSide()
    group = FakeWorkerGroup(min_workers=1, max_workers=MAX_WORKERS)
    side.carry(group.actions)
    side.carry(group.ready(*range(MAX_WORKERS)))
    most = 0
    for formation in range(FORMATIONS):
        offer = group.latest_offer.formation
        size = len(offer.members)
        if formation % 10 == 5 and size > 1:
            # A heal aborted half-way through its barrier: the last member dies before it arrives.
            side.arrive(offer.generation, range(size - 1))
            side.carry(group.die(offer.members[-1]))
            assert side.outcomes(offer.generation) == [False] * (size - 1)
            offer = group.latest_offer.formation
            size = len(offer.members)
        side.arrive(offer.generation, range(size))
        assert side.outcomes(offer.generation) == [True] * size
        side.carry(group.form(step=formation))
        group.commit_step(formation + 1)
        assert group.state == "RUNNING", group.state
        keys = side.store.num_keys()
        most = max(most, keys)
        assert keys <= len(generation_keys(offer.generation, size, "gloo")), (
            f"after formation {formation} (generation {offer.generation}, {size} members) the store holds "
            f"{keys} keys")
        # The next formation: a grow back to full size if a replacement is ready, else a heal.
        starting = [w for w, r in group.protocol.workers.items() if r.status == Status.STARTING]
        if starting:
            side.carry(group.ready(starting[0]))
        if group.state == "PREPARING":
            members = group.prepares[max(group.prepares)].members
            side.carry(group.answer_prepare({w: formation + 1 for w in members}))
        else:
            side.carry(group.die(group.protocol.members[0]))
    assert group.protocol.running >= FORMATIONS and most <= len(generation_keys(0, MAX_WORKERS, "gloo"))


def _two_generations(process, port):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    for generation in (0, 1):
        spec = GenerationSpec(generation=generation, rank=process, world_size=2, local_rank=0, local_world_size=1,
                              node_rank=process, store_host="127.0.0.1", store_port=port, backend="gloo",
                              reason="heal", collective_timeout_s=30.0)
        assert rendezvous(spec, store)
        form_group(spec, store)
        dist.all_reduce(torch.ones(1))
    leave_group("gloo")


def test_the_keys_forgotten_are_every_key_a_real_gloo_generation_left():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(_two_generations, args=(store.port,), nprocs=2, start_method=START_METHOD)
    assert store.num_keys() == 2 * len(generation_keys(0, 2, "gloo"))
    assert forget_generation(store, 0, 2, "gloo") == len(generation_keys(0, 2, "gloo"))
    assert forget_generation(store, 1, 2, "gloo") == len(generation_keys(1, 2, "gloo"))
    left = store.list_keys() if hasattr(store, "list_keys") else f"{store.num_keys()} keys"
    assert store.num_keys() == 0, f"gloo left keys that generation_keys does not name: {left}"
