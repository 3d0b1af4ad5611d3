"""A peer cut off by the network sends no reset: severing the generation's connections frees
whoever waits on it, in any collective, at any world size (no Ray).

Rank 2 stays alive but never joins the second all-reduce, as a rank behind a link that is down.
The others wait in a plain blocking `dist.all_reduce` (the train loop's own, which no comm hook
can abort) under an hour's timeout, until another thread severs their links: the all-reduce
fails as a peer failure, the store connection made before the group still works, and the same
processes form the next generation and reduce correctly. Without the sever the test hangs and
its timeout fails it.
"""

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.comm.links import GroupLinks
from gloo_processes import client, join, spawn

pytestmark = pytest.mark.timeout(120)
WORLD_SIZE = 3
CUT_OFF_RANK = 2
SEVER_AFTER_S = 0.3


def _member(rank, port, results):
    store = client(port)
    links = GroupLinks.opened_by(lambda: dist.init_process_group(
        "gloo", store=dist.PrefixStore("gen0", store), rank=rank, world_size=WORLD_SIZE, timeout=timedelta(hours=1)))
    dist.all_reduce(torch.ones(4))  # every rank takes part once
    if rank == CUT_OFF_RANK:
        store.wait(["reformed/0", "reformed/1"])  # alive, silent, its sockets open
        results[rank] = "cut off"
        return
    severed = []
    threading.Timer(SEVER_AFTER_S, lambda: severed.append(links.sever())).start()
    try:
        dist.all_reduce(torch.ones(4))
        raised = None
    except RuntimeError as exc:
        raised = exc
    health = links.health()  # read before the group is left: the kernel's word on its connections
    store.set(f"after-sever/{rank}", "the store connection predates the group: left alone")
    join(store, 1, rank, WORLD_SIZE - 1)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    store.set(f"reformed/{rank}", "1")
    results[rank] = {"peer_failure": raised is not None and health.broken, "severed": severed[0],
                     "store_ok": store.get(f"after-sever/{rank}").decode().startswith("the store"),
                     "next_sum": total.item()}


def test_severing_a_generation_frees_a_blocking_all_reduce_waiting_on_a_silent_peer_and_the_next_forms():
    results = spawn(_member, nprocs=WORLD_SIZE)
    assert results[CUT_OFF_RANK] == "cut off"
    for rank in (0, 1):
        outcome = results[rank]
        assert outcome["peer_failure"], f"rank {rank}: the all-reduce failed, but its links read sound"
        # At least its link to the cut-off rank; the other may already be closed by the peer's sever.
        assert outcome["severed"] >= 1, f"rank {rank}: severed nothing"
        assert outcome["store_ok"] and outcome["next_sum"] == 3.0


def test_links_opened_elsewhere_are_not_recorded():
    before = GroupLinks.opened_by(lambda: None)
    assert before.inodes == frozenset() and before.sever() == 0


PAYLOAD_FLOATS = 1 << 20  # 4 MB: a 2-rank ring sends each peer the whole tensor, half in each phase


def _sender(rank, port, results):
    store = client(port)
    links = GroupLinks.opened_by(lambda: dist.init_process_group(
        "gloo", store=dist.PrefixStore("traffic", store), rank=rank, world_size=2, timeout=timedelta(seconds=60)))
    before = links.traffic()
    dist.all_reduce(torch.ones(PAYLOAD_FLOATS))
    # The all-reduce can return before the peer acknowledged this rank's last segments (a busy
    # machine holds megabytes in flight on loopback); the peer's answer in a barrier carries the
    # acknowledgement of everything sent before it.
    dist.barrier()
    after = links.traffic()
    dist.destroy_process_group()
    results[rank] = {"before": before, "after": after, "closed": links.traffic()}


def test_traffic_counts_what_the_groups_connections_sent_each_peer_and_nothing_else():
    results = spawn(_sender, nprocs=2)
    for rank, seen in results.items():
        [(peer, (sent, busy_s))] = seen["after"].items()
        assert peer == "127.0.0.1"
        before = seen["before"].get(peer, (0, 0.0))[0]
        assert sent - before >= 4 * PAYLOAD_FLOATS, f"rank {rank} counted {sent - before} bytes"
        assert sent - before < 2 * 4 * PAYLOAD_FLOATS, "the store's connection (opened before the group) was counted"
        assert busy_s >= 0.0
        assert seen["closed"] == {}, "a destroyed group's closed connections still counted"
