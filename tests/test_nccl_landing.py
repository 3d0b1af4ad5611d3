"""On NCCL a collective returns once it is queued, so a rank waits for the generation's collectives
to land before anything they wrote commits (`GenerationGroup.wait_landed`): the optimizer's step,
a heal's state sync, ZeRO's gathered parameters, local SGD's average. A peer that dies before they
land fails the wait, once the control thread aborts the generation, instead of letting the rank
step on a partial sum. Two ranks share the one GPU (each a host of its own to NCCL, NCCL_HOSTID).
Skipped without CUDA; `sh tests/gpu_check.sh` runs it where there is a GPU.
"""

import multiprocessing
import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(120)]

ELEMENTS = 1 << 22  # a gradient of 16 MB: its all-reduce is still on the GPU when the host waits


def _member(rank, port, peer_dies, results):
    from elastic.comm import generation as generations
    from elastic.comm.binding import separate_ranks_sharing_a_gpu
    from elastic.comm.generation import GenerationGroup, peer_failed
    from elastic.comm.group import GenerationSpec, GradientAllReduce, StoreClient, form_group, rendezvous
    from elastic.comm.links import GroupLinks

    separate_ranks_sharing_a_gpu(rank, 0.5)
    torch.cuda.set_device(0)
    store = StoreClient().get("127.0.0.1", port)
    spec = GenerationSpec(generation=0, rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_rank=0,
                          store_host="127.0.0.1", store_port=port, backend="nccl", reason="test",
                          collective_timeout_s=60.0)
    assert rendezvous(spec, store)
    links = GroupLinks.opened_by(lambda: form_group(spec, store))
    group = GenerationGroup(0, "nccl", dist.group.WORLD, links, GradientAllReduce(0, abortable=False))
    generations.enter(group)
    gradients = torch.full((ELEMENTS,), float(rank + 1), device="cuda")
    dist.all_reduce(gradients)
    group.wait_landed()
    landed = {"sum": gradients[:1].cpu().item(), "errored": group.errored()}
    if not peer_dies:
        results[rank] = landed
        os._exit(0)  # NCCL's teardown at exit is not under test
    store.set(f"landed-{rank}", "1")
    if rank == 1:
        store.wait(["landed-0"])
        os.kill(os.getpid(), signal.SIGKILL)  # before the next all-reduce: rank 0's waits on a dead peer
    store.wait(["landed-1"])
    dist.all_reduce(gradients)  # queued; on the GPU it waits for rank 1, which never comes
    # The controller's heal offer reaches the control thread, which aborts the generation.
    threading.Timer(1.0, group.abort, args=("the test's controller: rank 1 died",)).start()
    try:
        group.wait_landed()
        results[rank] = {**landed, "second": "landed"}
    except Exception as exc:  # noqa: BLE001 (what it raised is the finding)
        results[rank] = {**landed, "second": f"{type(exc).__name__}: {exc}", "peer_failed": peer_failed(exc),
                         "errored": group.errored()}
    os._exit(0)


def _run(peer_dies: bool) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Manager().dict()
    processes = [context.Process(target=_member, args=(rank, store.port, peer_dies, results)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(50)
        if process.is_alive():  # hung: it must not hold the GPU for the checks after this one
            process.kill()
    return dict(results)


def test_collectives_that_landed_on_both_ranks_pass_the_wait_with_their_sum():
    results = _run(peer_dies=False)
    assert results == {0: {"sum": 3.0, "errored": None}, 1: {"sum": 3.0, "errored": None}}


def test_a_peer_that_dies_before_the_all_reduce_lands_fails_the_wait_as_a_peer_failure():
    results = _run(peer_dies=True)
    assert set(results) == {0}, results  # rank 1 was killed
    survivor = results[0]
    assert survivor["sum"] == 3.0, "the first all-reduce landed before the death"
    assert survivor["second"] != "landed" and survivor["peer_failed"], survivor
    assert survivor["errored"] is not None
