"""A generation whose connect failed leaves nothing that keeps the next one from forming (no Ray).

A member that dies right after a generation's barrier leaves the others waiting in gloo's connect
until its timeout; they then join the next generation, which may take in a worker that never saw
the failed one (a warm spare, a newcomer). torch counts the groups a process created, failed ones
included, and names a default group by that count, under which gloo's connect keys live: every
member must name the new generation's group alike, whatever generations failed before.
"""

import pytest
import torch
import torch.distributed as dist

from elastic.comm.group import GenerationSpec, form_group, leave_group
from gloo_processes import client, spawn

pytestmark = pytest.mark.timeout(120)
CONNECT_S = 0.5  # the failed generation's connect gives up after this (its collective timeout)


def _spec(generation, rank, world_size, port):
    return GenerationSpec(generation=generation, rank=rank, world_size=world_size, local_rank=rank,
                          local_world_size=world_size, node_rank=0, store_host="127.0.0.1", store_port=port,
                          backend="gloo", reason="heal", collective_timeout_s=CONNECT_S)


def _member(process, port, results):
    store = client(port)
    if process < 2:
        try:
            form_group(_spec(1, process, 3, port), store)  # the third member died after the barrier
            results[process] = "connected without its third member"
            return
        except Exception:
            pass
    store.add("failed", 1)
    while int(store.add("failed", 0)) < 3:  # every process is past generation 1
        pass
    try:
        form_group(_spec(2, process, 3, port), store)  # process 2 never saw generation 1
    except Exception as exc:
        results[process] = f"generation 2 did not form: {exc}"
        return
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    leave_group("gloo")
    results[process] = total.item()


def test_a_spare_that_never_saw_a_failed_connect_forms_the_next_generation_with_its_survivors():
    results = spawn(_member, nprocs=3)
    assert results == {0: 3.0, 1: 3.0, 2: 3.0}, results
