"""Sends and receives of a generation on gloo (`elastic.comm.generation.wait_p2p`), without Ray:
two processes form a generation whose groups connected within a short deadline, as a heal's do.

A receive that waits longer than that deadline for its sender (a pipeline stage waiting for its
neighbour's activations) completes, and the group stays sound; a send whose receiver gave up
(gloo waits for the receiver's readiness) fails at the generation's abort, as a peer's failure.
"""

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.comm import generation as generations
from elastic.comm.generation import GenerationGroup, peer_failed, wait_p2p
from elastic.comm.group import PEER_ABORT_MARKER, GradientAllReduce
from elastic.comm.links import GroupLinks
from gloo_processes import client, spawn

pytestmark = pytest.mark.timeout(120)
CONNECT_S = 0.2  # the generation's connect deadline: a plain wait() of a send or receive lasts this long
COLLECTIVE_S = 60
LATE_S = 5 * CONNECT_S  # how late the sender sends
ABORT = f"{PEER_ABORT_MARKER}: the controller offered a newer generation"


def _form(store, rank):
    # Both processes reach the connect together, as after a barrier's "go": the deadline is short.
    store.add("ready", 1)
    while store.add("ready", 0) < 2:
        time.sleep(0.001)
    links = GroupLinks.opened_by(lambda: dist.init_process_group(
        "gloo", store=dist.PrefixStore("generation/0", store), rank=rank, world_size=2,
        timeout=timedelta(seconds=CONNECT_S)))
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=COLLECTIVE_S))
    generations.enter(GenerationGroup(0, "gloo", dist.group.WORLD, links, GradientAllReduce(0, abortable=True)))


def _member(rank, port, results):
    store = client(port)
    _form(store, rank)
    got = {}
    tensor = torch.zeros(3)
    # A receive waiting longer than the connect deadline for a late sender.
    if rank == 0:
        time.sleep(LATE_S)
        wait_p2p(dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.arange(3.0), 1)]))
    else:
        wait_p2p(dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, 0)]))
        got["received"] = tensor.tolist()
    summed = torch.ones(1)
    dist.all_reduce(summed)  # the group is still sound
    got["summed"] = summed.item()
    # A send whose receiver never posts its receive: it ends at the generation's abort.
    if rank == 1:
        threading.Timer(LATE_S, generations.current().abort, args=(ABORT,)).start()
        try:
            wait_p2p(dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), 0)]))
            got["send"] = "completed"
        except RuntimeError as exc:
            got["send"] = str(exc)
            got["peer_failed"] = peer_failed(exc)
        store.set("done", "1")
    else:
        store.wait(["done"], timedelta(seconds=COLLECTIVE_S))
    results[rank] = got
    # Not the interpreter's exit: gloo's send to the peer that never received waits on, on a thread
    # of its own, until the collective timeout, and the group's destructor would join it.
    os._exit(0)


def test_a_late_sender_is_waited_for_past_the_connect_deadline_and_an_abandoned_send_ends_at_the_abort():
    results = spawn(_member, nprocs=2)
    assert results[1]["received"] == [0.0, 1.0, 2.0]
    assert results[0]["summed"] == results[1]["summed"] == 2.0
    assert results[1]["send"] == ABORT and results[1]["peer_failed"]
