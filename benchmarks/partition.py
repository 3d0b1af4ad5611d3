"""What a worker node cut off by the network costs, beside a SIGKILL of the same worker, on a real
multi-node Ray cluster in network namespaces (elastic.testing.NetworkCluster).

    .venv/bin/python -m benchmarks.partition                        # 3 rounds, about 16 minutes
    .venv/bin/python -m benchmarks.partition --paces 3s             # the 3 s steps only, about 8 minutes
    .venv/bin/python -m benchmarks.partition --rounds 1 --out /tmp/partition.json
    .venv/bin/python -m benchmarks.partition --cuts partial      # the partial partition only, about 3 minutes

Run it from the repository root, as root on Linux. The cluster is a head with no CPUs for workers
and three worker nodes of one CPU each; each run is tests/network_driver.py's: `regression_loop`
on 3 workers (min 2), a sleep inside each step standing for its compute (50 ms, 1 s and 3 s), rank 2's
node cut off (its link taken down) a moment into a step, and the link brought back once the
survivors healed. Beside it, the same run with rank 2's process SIGKILLed at the same moment.
Figures, each a median over the rounds with min, median and max under `spread.<key>`:

- partition_recovery_s.<pace>: from the cut to the survivors' first committed step (rank 0's
  commit times, logged by the loop), everything the survivors stood still included;
- partition_sigkill_recovery_s.<pace>: the same for the SIGKILL;
- partition_detect_s.<pace>: the `recovery` event's `detect_s`, the last commit to the moment the
  controller called the node unreachable;
- partial_partition_recovery_s: a partial partition at 0.3 s steps (`network_driver.cut_partially`:
  rank 1's node stops reaching the nodes of ranks 0 and 2, every node still reaches the head), from
  the cut to the survivors' first committed step;
- partial_partition_detect_s: its `recovery` event's `detect_s`, the last commit to the moment the
  controller called rank 1 cut off.

The keys are merged into benchmarks/results/bench.json (or --out), keeping the others.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench import command_line, merge_figures, parse_rounds, print_medians
from elastic.testing import NetworkCluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from network_driver import (FAST, MEASURED, SLOW, SLOWEST, Pace, cut_mid_step, cut_partially, events,  # noqa: E402
                            result, start_full)

PACES = {"50ms": FAST, "1s": SLOW, "3s": SLOWEST}


def first_commit_after(step_log: Path, moment: float, healed_at: float) -> float:
    """When rank 0 committed its first step once the healed generation formed, less `moment`."""
    times = [float(line.split()[1]) for line in step_log.read_text().splitlines()]
    return min(t for t in times if t > healed_at) - moment


def healed_at(found: list[dict], since: float) -> float:
    return next(e["time"] for e in found if e["type"] == "generation_formed" and e["kind"] == "heal"
                and e["time"] > since)


def partition_round(cluster: NetworkCluster, folder: Path, pace: Pace) -> dict[str, float]:
    log = folder / "partition-steps.log"
    cut = cut_mid_step(cluster, folder, pace, step_log=log, name="partition")
    [recovery] = [e for e in cut.events if e["type"] == "recovery"]
    return {"recovery_s": first_commit_after(log, cut.cut_at, healed_at(cut.events, cut.cut_at)),
            "detect_s": recovery["detect_s"]}


def partial_round(cluster: NetworkCluster, folder: Path) -> dict[str, float]:
    log = folder / "partial-steps.log"
    cut = cut_partially(cluster, folder, MEASURED, step_log=log, name="partial")
    [recovery] = [e for e in cut.events if e["type"] == "recovery"]
    return {"recovery_s": first_commit_after(log, cut.cut_at, healed_at(cut.events, cut.cut_at)),
            "detect_s": recovery["detect_s"]}


def sigkill_round(cluster: NetworkCluster, folder: Path, pace: Pace) -> float:
    log = folder / "sigkill-steps.log"
    driver, first, _ = start_full(cluster, folder, "sigkill", pace, step_log=log)
    time.sleep(pace.cut_after_s)
    killed_at = time.time()
    os.kill(first["members"][2]["pid"], signal.SIGKILL)  # the namespaces share this machine's pids
    result(driver, folder, "sigkill")
    return first_commit_after(log, killed_at, healed_at(events(folder, "sigkill"), killed_at))


def main(argv: list[str] | None = None) -> int:
    def arguments(p):
        p.add_argument("--paces", nargs="+", choices=list(PACES), default=list(PACES),
                       help="the step times to cut a node's link at")
        p.add_argument("--cuts", nargs="+", choices=["full", "partial"], default=["full", "partial"],
                       help="full: a node's link down (at each pace); partial: a node cut from its peers only")

    parser, args = parse_rounds(__doc__, argv, arguments)
    reason = NetworkCluster.unavailable()
    if reason is not None:
        parser.error(f"the network cluster cannot run here: {reason}")
    started = time.time()
    figures: dict[str, list[float | None]] = {}
    with NetworkCluster(nodes=4, cpus_per_node=1, head_cpus=0) as cluster, \
            tempfile.TemporaryDirectory(prefix="elastic-partition-") as storage:
        for round_index in range(args.rounds):
            if "partial" in args.cuts:
                folder = Path(storage) / f"round-{round_index}-partial"
                folder.mkdir()
                partial = partial_round(cluster, folder)
                figures.setdefault("partial_partition_recovery_s", []).append(partial["recovery_s"])
                figures.setdefault("partial_partition_detect_s", []).append(partial["detect_s"])
                print(f"round {round_index + 1}/{args.rounds} partial: {partial['recovery_s']:.2f} s "
                      f"(detect {partial['detect_s']:.2f} s), load {os.getloadavg()[0]:.1f}", flush=True)
            for label in args.paces if "full" in args.cuts else ():
                pace = PACES[label]
                folder = Path(storage) / f"round-{round_index}-{label}"
                folder.mkdir()
                cut = partition_round(cluster, folder, pace)
                killed = sigkill_round(cluster, folder, pace)
                figures.setdefault(f"partition_recovery_s.{label}", []).append(cut["recovery_s"])
                figures.setdefault(f"partition_detect_s.{label}", []).append(cut["detect_s"])
                figures.setdefault(f"partition_sigkill_recovery_s.{label}", []).append(killed)
                print(f"round {round_index + 1}/{args.rounds} {label}: cut {cut['recovery_s']:.2f} s "
                      f"(detect {cut['detect_s']:.2f} s), SIGKILL {killed:.2f} s, load {os.getloadavg()[0]:.1f}",
                      flush=True)
    merge_figures(args.out, figures, {}, {
        "partition_recovery_s": "a worker node's link taken down inside a step: seconds from the cut to the "
                                "survivors' first committed step, on a NetworkCluster (benchmarks/partition.py)",
        "partition_sigkill_recovery_s": "the same worker SIGKILLed at the same moment instead: seconds to the "
                                        "survivors' first committed step",
        "partition_detect_s": "the recovery event's detect_s: the last commit to the call that the node is unreachable",
        "partial_partition_recovery_s": "rank 1's node cut from the nodes of ranks 0 and 2 (each still reaching the "
                                        "head) inside a 0.3 s step: seconds from the cut to the survivors' first "
                                        "committed step (benchmarks/partition.py --cuts partial)",
        "partial_partition_detect_s": "its recovery event's detect_s: the last commit to the call that rank 1 is cut off",
    }, command_line("benchmarks.partition", argv), time.time() - started)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
