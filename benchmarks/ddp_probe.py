"""Plain torch DDP (no Ray, no elastic) over a shaped link: what bucket size lets gloo overlap the
all-reduce with the backward, and one worker's step cut into its phases. The figures behind
`GLOO_BUCKET_CAP_MB` (elastic/worker/data_parallel.py) and docs/techniques.md ("Over a slow link").

    .venv/bin/python -m benchmarks.ddp_probe                 # 1gbit, about 2 minutes
    .venv/bin/python -m benchmarks.ddp_probe --rate none     # unshaped

Run it from the repository root, as root on Linux. Two ranks in two nodes of a NetworkCluster,
one torch thread each, train benchmarks/network.py's MLP with AdamW; rank 0 prints the median
times in ms: the step's compute alone, one all-reduce of every gradient, and a DDP step at each
bucket size. Then this process times forward, backward and optimizer step on one thread.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script inside a node's namespace

from benchmarks.network import make_model  # noqa: E402

STORE_PORT = 29555
BUCKET_CAPS_MB = (25, 8, 4, 2)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, 1024), torch.randint(0, 10, (64,))


def rank_main(rank: int, master: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    store = dist.TCPStore(master, STORE_PORT, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    x, y = batch()

    def timed(step, n=15, warm=5) -> float:
        for _ in range(warm):
            step()
        dist.barrier()
        started = time.perf_counter()
        for _ in range(n):
            step()
        dist.barrier()
        return (time.perf_counter() - started) / n * 1e3

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)

    def compute() -> None:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    out = {"compute": timed(compute), "all_reduce": timed(lambda: dist.all_reduce(flat), n=8, warm=2)}
    for cap in BUCKET_CAPS_MB:
        ddp = DistributedDataParallel(make_model(), bucket_cap_mb=cap)
        ddp_optimizer = torch.optim.AdamW(ddp.parameters(), 1e-3)

        def step() -> None:
            F.cross_entropy(ddp(x), y).backward()
            ddp_optimizer.step()
            ddp_optimizer.zero_grad()

        out[f"ddp_{cap}mb"] = timed(step)
    if rank == 0:
        print("ms:", {name: round(value, 1) for name, value in out.items()}, flush=True)
    dist.destroy_process_group()


def phases() -> dict[str, float]:
    torch.set_num_threads(1)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    x, y = batch()
    times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for i in range(30):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t3 = time.perf_counter()
        if i >= 5:
            for name, value in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(value)
    return {name: round(statistics.median(values) * 1e3, 1) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help='tc rate of each worker link, or "none"')
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.master)
        return 0
    from elastic.testing import NetworkCluster

    with NetworkCluster(nodes=3, cpus_per_node=1, head_cpus=0) as cluster:
        for node in (1, 2):
            cluster.shape(node, None if args.rate == "none" else args.rate)
        master = cluster.node_ip(1)
        argv = [sys.executable, str(Path(__file__).resolve()), "--master", master, "--rank"]
        first = cluster.spawn_in(1, [*argv, "0"], stdout=subprocess.PIPE, text=True)
        second = cluster.spawn_in(2, [*argv, "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        printed, _ = first.communicate(timeout=600)
        second.wait(600)
    print(f"{args.rate}: {printed.strip()}")
    print("one worker, one thread, ms:", phases())
    return 0


if __name__ == "__main__":
    sys.exit(main())
