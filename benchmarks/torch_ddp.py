"""The baseline: plain DistributedDataParallel over gloo in WORLD_SIZE local processes.

The parent hosts the rendezvous TCPStore on a port the OS picks (bound via port 0) and
spawns the ranks; each rank trains, then writes its step stamps to a file the parent reads.
Nothing here touches Ray: benchmarks/bench.py runs this twice, bare and in a process that has
started an idle Ray instance first, so that the Ray systems are compared with DDP under the
same daemons.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from benchmarks import workload


def steady(steps: int) -> list[dict[str, Any]]:
    """Train `steps` steps; returns rank 0's step stamps."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as out_dir:
        mp.spawn(_rank, args=(store.port, steps, out_dir), nprocs=workload.WORLD_SIZE, join=True)
        with open(os.path.join(out_dir, "rank0.json")) as f:
            stamps = json.load(f)
    return stamps


def _rank(rank: int, port: int, steps: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=workload.WORLD_SIZE)
    model = DistributedDataParallel(workload.make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=workload.LR)
    stamps = []

    def after_step(step: int, loss: torch.Tensor) -> None:
        loss.item()
        stamps.append(workload.stamp(step, 0, workload.WORLD_SIZE, time.time()))

    workload.train_steps(model, optimizer, workload.make_dataset(), rank, workload.WORLD_SIZE, 0, steps, after_step)
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out_dir, "rank0.json"), "w") as f:
            json.dump(stamps, f)
