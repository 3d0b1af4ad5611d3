"""Whether a generation lost a peer is told from facts, never from an exception's text (no Ray).

Real gloo processes form a generation as a worker does (`GroupLinks.opened_by` around the
connect, a `GenerationGroup` entered), then meet what a run meets: a peer that dies, a peer that
stops reading (alive, but its process stopped), and the user's own errors worded as a network
failure would be. Only the first is a peer failure.
"""

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.comm import generation as generations
from elastic.comm.generation import GenerationGroup, peer_failed
from elastic.comm.group import GradientAllReduce
from elastic.comm.links import GroupLinks
from gloo_processes import client, spawn

pytestmark = pytest.mark.timeout(120)

USER_ERRORS = ("S3 read timed out while fetching shard 17", "metrics push failed: connection reset by peer",
               "cannot write the log: broken pipe", "Connection closed by peer")
# Far more than loopback's socket buffers hold, so that a peer that reads nothing stops the sender.
LARGE_FLOATS = 64 << 20
STOPPED_S = 2.0  # longer than TCP's first retransmission timeouts (200 ms, doubling)


def _enter(store, prefix, rank, world_size):
    links = GroupLinks.opened_by(lambda: dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, timeout=timedelta(seconds=60)))
    group = GenerationGroup(0, "gloo", dist.group.WORLD, links, GradientAllReduce(0, abortable=False))
    generations.enter(group)
    return group


def _death(rank, port, results):
    store = client(port)
    group = _enter(store, "death", rank, 2)
    dist.all_reduce(torch.ones(4))
    sound = {message: peer_failed(RuntimeError(message)) for message in USER_ERRORS}
    store.set(f"judged/{rank}", "1")
    store.wait(["judged/0", "judged/1"])  # both judged while the group is whole
    if rank == 1:
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(4))
        raised = None
    except RuntimeError as exc:
        raised = exc
    results[rank] = {"sound": sound, "raised": raised is not None, "peer_failed": raised is not None and peer_failed(raised),
                     "errored": group.errored() or "", "user_error_after": peer_failed(ValueError("a user bug"))}


def test_a_peers_death_is_a_peer_failure_and_a_users_error_worded_like_one_is_not():
    results = spawn(_death, nprocs=2)
    outcome = results[0]
    assert outcome["sound"] == {message: False for message in USER_ERRORS}, "a user's error was read as a peer's"
    assert outcome["raised"] and outcome["peer_failed"], "the all-reduce that lost its peer is not a peer failure"
    assert "closed" in outcome["errored"]
    # Once the generation lost a peer, whatever ends the step ends it for that reason: the heal redoes it.
    assert outcome["user_error_after"]


def _stopped(rank, port, results):
    store = client(port)
    group = _enter(store, "stopped", rank, 2)
    if rank == 1:
        store.set("pid", str(os.getpid()))
        store.wait(["sending"])
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, reads nothing: its window closes
        dist.all_reduce(torch.ones(LARGE_FLOATS))
        results[rank] = "resumed"
        return
    peer = int(store.get("pid"))
    store.set("sending", "1")
    time.sleep(0.2)  # the peer stops itself
    sender = threading.Thread(target=dist.all_reduce, args=(torch.ones(LARGE_FLOATS),))
    sender.start()
    time.sleep(STOPPED_S)
    health, errored = group.links.health(), group.errored()  # judged while the peer is stopped: it exits once resumed
    os.kill(peer, signal.SIGCONT)
    sender.join()
    results[rank] = {"broken": health.broken, "silent": health.silent, "closed": health.closed, "errored": errored}


def test_a_peer_that_stops_reading_is_slow_not_lost():
    results = spawn(_stopped, nprocs=2)
    assert results[1] == "resumed"
    outcome = results[0]
    # Its kernel still acknowledges (a closed window, answered probes): nothing is retransmitted on timeout.
    assert not outcome["broken"], outcome
    assert outcome["errored"] is None


def _aborted(rank, port, results):
    store = client(port)
    group = _enter(store, "aborted", rank, 2)
    dist.all_reduce(torch.ones(4))
    before = peer_failed(RuntimeError("timed out"))
    store.set(f"judged/{rank}", "1")
    store.wait(["judged/0", "judged/1"])  # an abort severs the peer's links too: judge before either
    group.abort("the controller offered generation 1 in place of 0")
    results[rank] = {"before": before, "errored": group.errored(), "after": peer_failed(RuntimeError("any"))}


def test_the_controllers_abort_latches_the_first_reason():
    results = spawn(_aborted, nprocs=2)
    for outcome in results.values():
        assert not outcome["before"]
        assert outcome["errored"] == "the controller offered generation 1 in place of 0"
        assert outcome["after"]
