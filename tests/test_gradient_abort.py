"""An all-reduce that waits for a silent peer is freed by an abort from another thread (no Ray).

gloo cannot abort an operation: a rank waiting for a peer learns of its loss only when a ring
neighbour drops the group. `GradientAllReduce` fails the future DDP waits on instead, and
`leave_group` lets go of the group without joining gloo's blocked thread.

The group's timeout is an hour and the silent rank stays until the others have left: without
the abort, or with a leave that waits for gloo, the test hangs and its timeout fails it.
"""

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.comm.group import PEER_ABORT_MARKER, GradientAllReduce, leave_group
from gloo_processes import START_METHOD

pytestmark = pytest.mark.timeout(120)
WORLD_SIZE = 3
SILENT_RANK = 2
ABORT_AFTER_S = 0.3


def _member(rank, port, results):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(hours=1))
    collectives = GradientAllReduce(generation=0, abortable=True)
    collectives.all_reduce(torch.ones(4)).wait()  # every rank takes part once
    if rank == SILENT_RANK:
        store.wait(["left/0", "left/1"])  # alive, but never joins the second all-reduce
        results[rank] = "silent"
        return
    threading.Timer(ABORT_AFTER_S, collectives.abort, args=(f"{PEER_ABORT_MARKER}: a peer is gone",)).start()
    try:
        collectives.all_reduce(torch.ones(4)).wait()
        raised = None
    except RuntimeError as exc:
        raised = exc
    leave_group("gloo")  # gloo's operation is still blocked on the silent rank
    later = collectives.all_reduce(torch.ones(4))
    try:
        later.wait()
        later_failed = False
    except RuntimeError:
        later_failed = True
    results[rank] = {"peer_failure": raised is not None and str(raised) == collectives.aborted, "later_failed": later_failed}
    store.set(f"left/{rank}", "1")


def test_an_abort_frees_an_all_reduce_blocked_on_a_silent_peer_and_the_group_is_left_at_once():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = mp.Manager().dict()
    mp.start_processes(_member, args=(store.port, results), nprocs=WORLD_SIZE, start_method=START_METHOD)
    for rank in range(WORLD_SIZE):
        if rank == SILENT_RANK:
            continue
        outcome = results[rank]
        assert outcome["peer_failure"], "the aborted all-reduce did not fail with the abort's reason"
        assert outcome["later_failed"], "an all-reduce after the abort was started"
