"""State sync over a real gloo group of two processes (no Ray): the most advanced rank wins."""

import hashlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.comm.state_sync import sync_state
from gloo_processes import START_METHOD

pytestmark = pytest.mark.timeout(120)


def _digest(model, optimizer):
    digest = hashlib.sha256()
    for tensor in list(model.state_dict().values()) + [
        v for state in optimizer.state_dict()["state"].values() for v in state.values() if torch.is_tensor(v)
    ]:
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _member(rank, port, steps, results):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(rank)  # every rank starts from different weights
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    counter = torch.zeros(5)
    for _ in range(steps[rank]):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        counter += 1
    result, progress = sync_state(
        {"model": model, "optimizer": optimizer, "counter": counter},
        {"step": steps[rank], "cursor": {"epoch": rank, "consumed": steps[rank]}},
        torch.device("cpu"),
    )
    results[rank] = (result.source_rank, progress, _digest(model, optimizer), counter.tolist())
    dist.destroy_process_group()


@pytest.mark.parametrize("steps, source", [((3, 0), 0), ((1, 4), 1), ((2, 2), 0)])
def test_the_most_advanced_rank_broadcasts_model_optimizer_and_progress(steps, source):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = mp.Manager().dict()
    mp.start_processes(_member, args=(store.port, steps, results), nprocs=2, start_method=START_METHOD)
    (src0, progress0, digest0, counter0), (src1, progress1, digest1, counter1) = results[0], results[1]
    assert src0 == src1 == source
    assert progress0 == progress1 == {"step": steps[source], "cursor": {"epoch": source, "consumed": steps[source]}}
    assert digest0 == digest1, "model and optimizer state differ after the sync"
    assert counter0 == counter1 == [float(steps[source])] * 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_travels_as_flat_buffers_and_each_tensor_returns_to_its_device():
    from elastic.comm.flat_state import flatten, unflatten

    model = torch.nn.Linear(4, 3).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    structure, buffers = flatten(state, torch.device("cuda"))
    assert all(b.is_cuda for b in buffers.values())
    back = unflatten(structure, buffers)
    for name, tensor in state["model"].items():
        assert torch.equal(back["model"][name], tensor)
    for index, slots in state["optimizer"]["state"].items():
        for key, tensor in slots.items():
            assert back["optimizer"]["state"][index][key].device == tensor.device
            assert torch.equal(back["optimizer"]["state"][index][key], tensor)
