"""The formation barrier and its forgetting against a real TCPStore, at up to 256 simulated members.

    .venv/bin/python -m benchmarks.store_barrier                      # W = 16, 64, 256; 3 rounds
    .venv/bin/python -m benchmarks.store_barrier --sizes 16 256 --rounds 1 --out /tmp/bench.json

No Ray and no training. This process hosts the TCPStore, as the controller does; PROCESSES
processes host the members, as threads, each with a connection of its own (a worker keeps one),
up to 256 in all. For each round and each W, W members are released at once into generation g's
barrier (`elastic.comm.group.rendezvous`); after its "go" each writes its address where gloo's
connect would (~8W bytes, under the default group's prefixes); then this process forgets the
generation (`forget_generation`), as the controller does once a later one commits.

Figures, each the median over the rounds with min, median and max under `spread`:

- store_barrier_s.<W>: from the last member's call into the barrier to the last member's return
  from it: what the barrier itself adds once everyone is there (the last arrival's count and
  "go", and the wake-up of W waiters), without the spread of the release;
- store_forget_s.<W>: deleting what the generation left (W + 2 keys, one request each).

The figures merge into benchmarks/results/bench.json unless --out says otherwise.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from benchmarks.bench import command_line, merge_figures, parse_rounds, print_medians
from elastic.comm.group import GenerationSpec, forget_generation, generation_keys, rendezvous

SIZES = (16, 64, 256)
PROCESSES = 4
READY = "bench/ready"  # counts the members connected
RELEASE = "bench/release/{generation}"  # its value: the world size, or 0 to stop
SEEN = "bench/seen/{generation}"  # counts the members that saw the release: it may go then
TIMES = "bench/times/{generation}/{rank}"
DEFINITIONS = {
    "store_barrier_s": "benchmarks/store_barrier.py: W members (threads in 4 processes, a TCPStore connection "
                       "each) released at once into a generation's barrier on a real TCPStore hosted by the "
                       "benchmark's process: from the last member's call into the barrier to the last member's "
                       "return from it",
    "store_forget_s": "the same run: deleting what one generation of W members left in the store "
                      "(forget_generation: its barrier's 2 keys and W gloo connect addresses)",
}


def _member(rank: int, port: int) -> None:
    """One simulated worker: waits for each release, and takes part when its rank is inside the world size."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    store.add(READY, 1)
    generation = 0
    while True:
        release = RELEASE.format(generation=generation)
        store.wait([release])
        world_size = int(store.get(release))
        store.add(SEEN.format(generation=generation), 1)
        if world_size == 0:
            return
        if rank < world_size:
            spec = GenerationSpec(generation=generation, rank=rank, world_size=world_size, local_rank=0,
                                  local_world_size=1, node_rank=0, store_host="127.0.0.1", store_port=port,
                                  backend="gloo", reason="heal", collective_timeout_s=30.0)
            began = time.monotonic()
            went = rendezvous(spec, store)
            ended = time.monotonic()
            if went:
                connect = dist.PrefixStore("0", dist.PrefixStore("cpu/", dist.PrefixStore("0/", dist.PrefixStore(
                    f"{spec.prefix}/group", store))))
                connect.set(str(rank), b"\0" * 8 * world_size)  # gloo's record: about a pair id per peer
            store.set(TIMES.format(generation=generation, rank=rank), f"{began} {ended}")
        generation += 1


def _members(ranks: list[int], port: int) -> None:
    threads = [threading.Thread(target=_member, args=(rank, port)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _barrier_once(store: dist.TCPStore, generation: int, world_size: int, members: int) -> tuple[float, float]:
    store.set(RELEASE.format(generation=generation), str(world_size))
    keys = [TIMES.format(generation=generation, rank=rank) for rank in range(world_size)]
    store.wait(keys)
    times = [tuple(map(float, value.decode().split())) for value in store.multi_get(keys)]
    _wait_for_count(store, SEEN.format(generation=generation), members)
    for key in [*keys, RELEASE.format(generation=generation), SEEN.format(generation=generation)]:
        store.delete_key(key)
    began = time.perf_counter()
    deleted = forget_generation(store, generation, world_size, "gloo")
    forget_s = time.perf_counter() - began
    if deleted != len(generation_keys(generation, world_size, "gloo")) or store.num_keys() != 1:  # READY stays
        raise RuntimeError(f"generation {generation}: {deleted} keys deleted, {store.num_keys() - 1} left")
    return max(end for _, end in times) - max(start for start, _ in times), forget_s


def _wait_for_count(store: dist.TCPStore, key: str, count: int) -> None:
    while store.add(key, 0) < count:
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    _, args = parse_rounds(__doc__, argv, lambda parser: parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(SIZES), help="world sizes (default %(default)s)"))
    sizes, most = args.sizes, max(args.sizes)
    started = time.time()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    spawn = multiprocessing.get_context("spawn")
    hosts = [spawn.Process(target=_members, args=(list(range(p, most, PROCESSES)), store.port))
             for p in range(PROCESSES)]
    for host in hosts:
        host.start()
    _wait_for_count(store, READY, most)  # a member still connecting would miss a release
    barrier: dict[int, list[float | None]] = {size: [] for size in sizes}
    forget: dict[int, list[float | None]] = {size: [] for size in sizes}
    generation = 0
    try:
        # Rounds outside, sizes inside: a burst of load on the machine hits every size alike.
        for round_index in range(args.rounds):
            for size in sizes:
                barrier_s, forget_s = _barrier_once(store, generation, size, most)
                generation += 1
                barrier[size].append(barrier_s)
                forget[size].append(forget_s)
                print(f"[store_barrier] W={size} round {round_index}: barrier {barrier_s * 1e3:.2f} ms, "
                      f"forget {forget_s * 1e3:.2f} ms", flush=True)
    finally:
        store.set(RELEASE.format(generation=generation), "0")
        for host in hosts:
            host.join(timeout=60)
    figures = {**{f"store_barrier_s.{size}": values for size, values in barrier.items()},
               **{f"store_forget_s.{size}": values for size, values in forget.items()}}
    details = {"store_barrier_setup": {"sizes": sizes, "rounds": args.rounds, "processes": PROCESSES,
                                       "cpu_count": os.cpu_count()}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.store_barrier", argv),
                  time.time() - started)
    print_medians(figures)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
