"""Real gloo processes without Ray, for the tests of what runs inside one generation's group:
start N processes, form generation after generation in the same processes (as a worker does
at each heal and grow), and collect what each reports."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.errors import ElasticError


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def join(store: dist.TCPStore, generation: int, rank: int, world_size: int) -> None:
    """Leave the current group, if any, and form generation `generation` in the same process."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))


# The processes are forked from a fork server that imported torch and elastic once (a fresh
# interpreter, started like a spawned process, that runs no Ray or torch thread, so forking it is
# safe), instead of each importing them anew as a spawned process does: ~2 s of CPU a process on
# 2 cores.
START_METHOD = "forkserver"
mp.set_forkserver_preload(["torch", "torch.distributed", "elastic", "workloads"])


def spawn(member, *args, nprocs: int = 3) -> dict:
    """Run `member(process, port, *args, results)` in `nprocs` new processes; their `results`."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = mp.Manager().dict()
    mp.start_processes(member, args=(store.port, *args, results), nprocs=nprocs, start_method=START_METHOD)
    return dict(results)


def refused(call) -> str | None:
    """The message of the ElasticError `call()` raises, or None if it raises none."""
    try:
        call()
    except ElasticError as exc:
        return str(exc)
    return None
