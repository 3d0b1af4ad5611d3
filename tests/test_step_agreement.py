"""The end-of-step agreement of a run of replicas (`GradientAllReduce.agree`), without Ray.

Ranks are threads, each with its own client of a real TCPStore, as workers hold theirs to the
controller's. A rank "dies" by stopping where it is; the controller's heal offer reaches each
survivor as an abort of its generation's collectives, at a moment of its own.
"""

import random
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic.comm.group import PEER_ABORT_MARKER, GradientAllReduce, _agreement_keys

pytestmark = pytest.mark.timeout(60)
GENERATION = 3


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield master
    del master


@pytest.fixture
def clients(store):
    """Each rank's own connection to the store, kept for the test as a worker keeps its own."""
    return [dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=10)) for _ in range(3)]


def _agree_in_thread(client, collectives, step, world_size, outcomes, rank, delay_s=0.0):
    def run():
        time.sleep(delay_s)
        try:
            collectives.agree(client, step, world_size)
            outcomes[rank] = "stepped"
        except RuntimeError as exc:
            outcomes[rank] = "peer failure" if str(exc).startswith(PEER_ABORT_MARKER) else repr(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_every_rank_steps_once_all_averaged_and_the_step_before_leaves_no_keys(store, clients):
    ranks = [GradientAllReduce(GENERATION, abortable=True) for _ in range(3)]
    for step in (7, 8):
        outcomes = {}
        for thread in [_agree_in_thread(clients[r], c, step, 3, outcomes, r) for r, c in enumerate(ranks)]:
            thread.join(10)
        assert outcomes == {0: "stepped", 1: "stepped", 2: "stepped"}, f"step {step}: {outcomes}"
    assert not store.check(list(_agreement_keys(GENERATION, 7))), "step 7's keys outlived step 8's agreement"
    assert store.check(list(_agreement_keys(GENERATION, 8)))


def test_a_rank_whose_average_failed_holds_the_others_until_one_abort_fails_them_all(clients):
    ranks = [GradientAllReduce(GENERATION, abortable=True) for _ in range(3)]
    outcomes = {}
    # Rank 2's average failed: it never counts itself in.
    threads = [_agree_in_thread(clients[r], ranks[r], 0, 3, outcomes, r) for r in (0, 1)]
    time.sleep(0.2)
    assert outcomes == {}, "a rank stepped while another had not averaged"
    ranks[0].abort("process group was aborted: the controller offered generation 4")  # the offer reached rank 0 only
    for thread in threads:
        thread.join(10)
    assert outcomes == {0: "peer failure", 1: "peer failure"}


def test_every_survivor_reads_the_same_outcome_wherever_the_death_and_the_offer_land(store, clients):
    """A collective fails this: a death inside it can complete it on some ranks and not others."""
    chance = random.Random(11)
    seen = set()
    for step in range(40):
        ranks = [GradientAllReduce(GENERATION, abortable=True) for _ in range(4)]
        outcomes = {}
        threads = [_agree_in_thread(clients[r], ranks[r], step, 4, outcomes, r, delay_s=chance.uniform(0, 0.01))
                   for r in (0, 1, 2)]
        if chance.random() < 0.5:
            time.sleep(chance.uniform(0, 0.01))
            store.add(_agreement_keys(GENERATION, step)[0], 1)  # rank 3 counted itself in, then died
        for rank in (0, 1, 2):
            time.sleep(chance.uniform(0, 0.005))
            ranks[rank].abort("process group was aborted: the controller offered the next generation")
        for thread in threads:
            thread.join(10)
        assert len(set(outcomes.values())) == 1 and len(outcomes) == 3, f"step {step}: survivors differ: {outcomes}"
        seen.add(outcomes[0])
    assert seen == {"stepped", "peer failure"}, f"the schedule never tried both outcomes: {seen}"
