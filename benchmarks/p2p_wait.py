"""What waiting on sends and receives through the generation costs (`elastic.comm.generation.wait_p2p`),
beside torch's plain `wait()`.

    .venv/bin/python -m benchmarks.p2p_wait               # 3 rounds, about 20 s
    .venv/bin/python -m benchmarks.p2p_wait --rounds 1 --out /tmp/p2p.json

Two processes on this machine form a gloo group inside a generation (as a worker's is) and pass
a tensor of 4096 floats back and forth EXCHANGES times, as a pipeline's stages pass activations
and gradients: one `batch_isend_irecv` and one wait per exchange. Each round times that loop
with `wait_p2p` (the works waited for on the generation's own thread, so that an abort ends the
wait) and with a plain `wait()` on each work, alternating, in fresh processes.

- p2p_wait_overhead_us: the extra time per exchange, (wait_p2p - plain) / EXCHANGES, in µs;
- p2p_wait_ratio: the loop's time with wait_p2p over the plain one.

The keys are merged into benchmarks/results/bench.json (or --out), keeping the others.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.bench import command_line, merge_figures, parse_rounds, print_medians
from elastic.comm import generation as generations
from elastic.comm.generation import GenerationGroup, wait_p2p
from elastic.comm.group import GradientAllReduce
from elastic.comm.links import GroupLinks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gloo_processes import client, spawn  # noqa: E402

EXCHANGES = 2000
WARMUP = 200


def _loop(rank: int, through_generation: bool, count: int) -> float:
    tensor = torch.ones(4096)
    peer = 1 - rank
    started = time.perf_counter()
    for i in range(count):
        op = dist.P2POp(dist.isend if (i + rank) % 2 == 0 else dist.irecv, tensor, peer)
        works = dist.batch_isend_irecv([op])
        if through_generation:
            wait_p2p(works)
        else:
            for work in works:
                work.wait()
    return time.perf_counter() - started


def _member(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    store = client(port)
    links = GroupLinks.opened_by(lambda: dist.init_process_group(
        "gloo", store=dist.PrefixStore("generation/0", store), rank=rank, world_size=2, timeout=timedelta(seconds=60)))
    generations.enter(GenerationGroup(0, "gloo", dist.group.WORLD, links, GradientAllReduce(0, abortable=True)))
    times = {}
    for through_generation in (True, False, True, False):
        _loop(rank, through_generation, WARMUP)
        dist.barrier()
        times.setdefault(through_generation, []).append(_loop(rank, through_generation, EXCHANGES))
    results[rank] = {"generation": min(times[True]), "plain": min(times[False])}
    os._exit(0)  # the generation's waiting thread is a daemon; nothing to tear down


def main(argv: list[str] | None = None) -> int:
    _, args = parse_rounds(__doc__, argv)
    started = time.time()
    figures: dict[str, list[float | None]] = {"p2p_wait_overhead_us": [], "p2p_wait_ratio": []}
    for round_index in range(args.rounds):
        result = spawn(_member, nprocs=2)[0]
        overhead_us = (result["generation"] - result["plain"]) / EXCHANGES * 1e6
        figures["p2p_wait_overhead_us"].append(overhead_us)
        figures["p2p_wait_ratio"].append(result["generation"] / result["plain"])
        print(f"round {round_index + 1}/{args.rounds}: plain {result['plain'] / EXCHANGES * 1e6:.1f} µs, "
              f"through the generation {result['generation'] / EXCHANGES * 1e6:.1f} µs per exchange, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    merge_figures(args.out, figures, {}, {
        "p2p_wait_overhead_us": "extra µs per send/receive exchange of 4096 floats between 2 gloo processes when "
                                "waited for through the generation (wait_p2p) instead of a plain wait() "
                                "(benchmarks/p2p_wait.py)",
        "p2p_wait_ratio": "the exchange loop's time through the generation over its time with plain waits",
    }, command_line("benchmarks.p2p_wait", argv), time.time() - started)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
