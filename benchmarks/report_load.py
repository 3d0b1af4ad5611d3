"""The controller's CPU for step reports at 100 to 10,000 simulated workers: a load generator of
report calls against the real controller actor.

    .venv/bin/python -m benchmarks.report_load                  # W = 100, 1000, 10000; 3 rounds
    .venv/bin/python -m benchmarks.report_load --sizes 100 --rounds 1 --window-s 3 --out /tmp/bench.json

It starts Ray on this machine, creates one `actors.controller.Controller` for a run that is never
started (so no worker, and no tick, runs), and the driver sends it the `ingest` calls that W
workers send under `elastic.worker.reports`, each rank committing a step every --step-s seconds
and reporting the user's metrics with it:

- `report_cpu_cores`: the rule without the straggler check: rank 0's calls every
  REPORT_INTERVAL_S, each with the steps and metrics it committed since its last;
- `report_cpu_cores_straggler_check`: with it: rank 0's as above, and every other rank's at its
  turns (`next_turn`, once per `interval_s(W)`), each with all it reported since its last call;
- before: every worker's call every REPORT_INTERVAL_S, as before this rule, at 100 workers
  (500 calls a second; more than the driver can send on 2 cores at larger W), in the setup as
  `before_cpu_cores_100` and the controller's CPU per call, `before_ms_per_call_100`.

The figure is the controller process's CPU seconds (user + system, psutil) over a window of
--window-s seconds of calls, divided by the window's wall time: the cores its reports take,
Ray's receiving of each call included. The calls of a window are sent on the generator's clock
and awaited at its end; a window whose calls were sent late (the driver lagging on a loaded
machine) is reported in the setup (`lag_s`), since the load it produced was lower than the rule's.

The figures merge into benchmarks/results/bench.json (unless --out) as
`scale_simulated.<W>.report_cpu_cores` and `scale_simulated.<W>.report_cpu_cores_straggler_check`,
each the median over the rounds, with min, median and max under `spread`;
`scale_simulated_reports_setup` holds the settings, calls per second and the before figures.
"""

from __future__ import annotations

import heapq
import os
import statistics
import tempfile
import time
from typing import Any

import psutil
import ray

from actors.controller import Controller, RunSpec
from benchmarks.bench import command_line, merge_figures, parse_rounds, print_medians
from elastic.config import DataConfig, RunConfig, ScalingConfig, Strategy
from elastic.worker.reports import REPORT_INTERVAL_S, interval_s, next_turn

SIZES = (100, 1000, 10000)
STEP_S = 0.5
WINDOW_S = 10.0
BEFORE_SIZE = 100
GLOBAL_BATCH = 1024
DEFINITIONS = {
    "scale_simulated.report_cpu_cores": "cores of the real controller actor's CPU (psutil, user + system) taken by "
        "the step reports W simulated workers send under elastic.worker.reports (rank 0 every 0.2 s), each rank "
        "committing a step every step_s with a metrics report (benchmarks/report_load.py)",
    "scale_simulated.report_cpu_cores_straggler_check": "the same with FailureConfig(straggler_factor) set: every "
        "rank also sends what it reported once per max(0.2, W / REPORT_CALLS_PER_S) s at its turn",
}


class Generator:
    """The report calls of `size` ranks under the rule, sent to `controller` on a clock."""

    def __init__(self, controller: Any, size: int, step_s: float, mode: str) -> None:
        self.controller, self.size, self.step_s, self.mode = controller, size, step_s, mode

    def run(self, window_s: float) -> tuple[int, float]:
        """Send a window of calls, in the steady state: each rank's first call carries what it
        reported since its call before, one interval back. The calls sent, and how late the
        latest was sent."""
        began = time.time()
        turns = [(began, 0)]  # (when, rank)
        if self.mode == "straggler_check":
            turns += [(next_turn(rank, self.size, began), rank) for rank in range(1, self.size)]
        elif self.mode == "before":
            turns += [(began + REPORT_INTERVAL_S * rank / self.size, rank) for rank in range(1, self.size)]
        heap = [(at, rank, at - self._every(rank)) for at, rank in turns]  # (when, rank, its call before)
        heapq.heapify(heap)
        refs, lag = [], 0.0
        while heap[0][0] < began + window_s:
            at, rank, last = heapq.heappop(heap)
            wait = at - time.time()
            if wait > 0:
                time.sleep(wait)
            lag = max(lag, time.time() - at)
            refs.append(self.controller.ingest.remote(rank, self._items(rank, last, at)))
            heapq.heappush(heap, (at + self._every(rank), rank, at))
        ray.get(refs)
        return len(refs), lag

    def _every(self, rank: int) -> float:
        return interval_s(self.size) if self.mode == "straggler_check" and rank else REPORT_INTERVAL_S

    def _items(self, rank: int, since: float, until: float) -> list[dict[str, Any]]:
        """What `rank` reported from `since` to `until`: a step and its metrics every step_s."""
        items = []
        first, last = int(since / self.step_s) + 1, int(until / self.step_s)
        for step in range(first, last + 1):
            at = step * self.step_s
            items.append({"kind": "step", "step": step, "rank": rank, "world_size": self.size, "generation": 1,
                          "step_s": self.step_s, "compute_s": 0.6 * self.step_s, "samples": GLOBAL_BATCH,
                          "time": at})
            items.append({"kind": "metrics", "step": step, "rank": rank, "time": at,
                          "metrics": {"loss": 2.0 / (1 + step * 1e-3), "lr": 1e-3}})
        return items


def measure(controller: Any, process: psutil.Process, size: int, step_s: float, mode: str,
            window_s: float) -> dict[str, float]:
    generator = Generator(controller, size, step_s, mode)
    generator.run(min(2.0, window_s))  # warm up: the controller's first calls
    began_cpu, began = _cpu_s(process), time.time()
    calls, lag = generator.run(window_s)
    wall = time.time() - began
    cpu = _cpu_s(process) - began_cpu
    return {"cores": cpu / wall, "calls_per_s": calls / wall, "lag_s": lag, "ms_per_call": 1e3 * cpu / max(1, calls)}


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main(argv: list[str] | None = None) -> int:
    _, args = parse_rounds(__doc__, argv, lambda parser: (
        parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES)),
        parser.add_argument("--step-s", type=float, default=STEP_S),
        parser.add_argument("--window-s", type=float, default=WINDOW_S),
    ))
    started = time.time()
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        spec = RunSpec(lambda: None, {}, ScalingConfig(min_workers=1, max_workers=1),
                       RunConfig(name="report-load", storage_path=tempfile.mkdtemp(prefix="report-load-")),
                       DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH, max_steps=10**9),
                       Strategy())
        controller = Controller.remote(spec)
        process = psutil.Process(ray.get(controller.__ray_call__.remote(lambda self: os.getpid())))
        figures: dict[str, list[float | None]] = {}
        setup: dict[str, Any] = {"step_s": args.step_s, "window_s": args.window_s, "rounds": args.rounds,
                                 "sizes": args.sizes, "cpu_count": os.cpu_count(), "calls_per_s": {}, "lag_s": {},
                                 "before": {}}
        # Rounds outside, sizes inside: a burst of load on the machine hits every size alike.
        for round_index in range(args.rounds):
            for size in args.sizes:
                for mode, key in (("rank_0", "report_cpu_cores"),
                                  ("straggler_check", "report_cpu_cores_straggler_check")):
                    got = measure(controller, process, size, args.step_s, mode, args.window_s)
                    figures.setdefault(f"scale_simulated.{size}.{key}", []).append(got["cores"])
                    setup["calls_per_s"].setdefault(f"{size}.{mode}", []).append(round(got["calls_per_s"], 1))
                    setup["lag_s"].setdefault(f"{size}.{mode}", []).append(round(got["lag_s"], 3))
                    print(f"[report_load] round {round_index} W={size} {mode}: {got['cores']:.3f} cores, "
                          f"{got['calls_per_s']:.0f} calls/s, {got['ms_per_call']:.2f} ms/call, "
                          f"lag {got['lag_s']:.2f} s", flush=True)
            got = measure(controller, process, BEFORE_SIZE, args.step_s, "before", args.window_s)
            setup["before"].setdefault(f"cpu_cores_{BEFORE_SIZE}", []).append(got["cores"])
            setup["before"].setdefault(f"ms_per_call_{BEFORE_SIZE}", []).append(got["ms_per_call"])
            setup["before"].setdefault(f"lag_s_{BEFORE_SIZE}", []).append(round(got["lag_s"], 3))
            print(f"[report_load] round {round_index} before, W={BEFORE_SIZE} every rank every "
                  f"{REPORT_INTERVAL_S} s: {got['cores']:.3f} cores, {got['calls_per_s']:.0f} calls/s, "
                  f"{got['ms_per_call']:.2f} ms/call, lag {got['lag_s']:.2f} s", flush=True)
        for name, values in list(setup["before"].items()):
            setup["before"][name] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    finally:
        ray.shutdown()
    merge_figures(args.out, figures, {"scale_simulated_reports_setup": setup}, DEFINITIONS,
                  command_line("benchmarks.report_load", argv), time.time() - started)
    print_medians(figures)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
