"""The controller's protocol at 100 to 10,000 simulated workers: its CPU seconds per event.

    .venv/bin/python -m benchmarks.scale --simulated                       # W = 100, 1000, 10000; 3 rounds
    .venv/bin/python -m benchmarks.scale --simulated --sizes 100 1000 --rounds 1 --out /tmp/bench.json

No Ray and no worker processes: the pure protocol (`elastic.controller.protocol`) is driven by
the fake worker group (`elastic.controller.fake_group`), as in tests/test_protocol.py. Each round
at W workers (min_workers W/2, max_workers W) goes through:

- start: W workers report ready, the first generation is offered, W members acknowledge it;
- heal: worker 1 dies; the W-1 survivors report their broken group, then acknowledge the heal;
- grow: its replacement reports ready, the W-1 members answer the prepare with their step, and
  the W members acknowledge the grow;
- wave: 1% of the members (W/100, at least 1) die within 100 ms, each aborting the pending heal
  and offering the next; the survivors report their broken group and acknowledge the last heal.
  The first death comes alone and the others in one batch, as the controller steps through them:
  they queue while it sends the first heal's offer (W calls, seconds at 10,000), and the offers
  and aborts of the heals they withdraw are never sent (`signals.coalesce`);
- replay: the journal those events make (each Emit as the controller journals it) is written to
  a run folder, and a restarted controller's path is timed: `read_events`, `resume` and a new
  `Protocol` with what it resumed.

Every observation is built before its event is timed, so the figures are what the controller
spends deciding: `time.process_time` around the protocol's steps (and the fake group's carrying
out of the actions, a list append each). Between events the run commits a step
(`FakeWorkerGroup.commit_step`), as training would, so no event counts towards the crash-loop bound.

The figures merge into benchmarks/results/bench.json (unless --out) as
`scale_simulated.<W>.<event>_cpu_s` and `scale_simulated.<W>.replay_s`, each the median over the
rounds, with min, median and max under `spread`; `scale_simulated_setup` holds the observation
counts of each event. `scale_simulated.<W>.wave_worker_calls` counts the calls to workers the
wave's offers, prepares and aborts make as the controller sends them, and
`..._calls_one_batch_per_death` as they went when each death was stepped and sent on its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from benchmarks.bench import DEFAULT_OUT, command_line, merge_figures, print_medians
from elastic.checkpoint.storage import RunStorage
from elastic.controller.fake_group import FakeWorkerGroup, death
from elastic.controller.protocol import Protocol
from elastic.controller.signals import (
    Abort, Action, Emit, GroupBroken, Observation, Offer, Prepare, SwitchPrepared, WorkerReady, coalesce,
)
from elastic.journal.events import EventJournal, read_events
from elastic.journal.resume import resume

SIZES = (100, 1000, 10000)
ROUNDS = 3
WAVE_FRACTION = 0.01
WAVE_WINDOW_S = 0.1
READY_GAP_S = 1e-4  # 10,000 workers ready within 1 s: inside the start's grace
ATTEMPT = "simulated"
EVENTS = ("heal", "grow", "wave")
DEFINITIONS = {
    "scale_simulated": "the pure protocol driven by the fake worker group at W simulated workers (benchmarks/"
                       "scale_simulated.py): CPU seconds (time.process_time) of one heal (a death, the survivors' "
                       "broken-group reports and acknowledgements), one grow (a newcomer ready, the members' prepare "
                       "answers, the acknowledgements), a wave of W/100 deaths within 100 ms and its heal, and "
                       "replay_s: reading back the journal those events made, resuming from it and building the "
                       "restarted controller's Protocol",
    "scale_simulated.wave_worker_calls": "the calls to workers (one per member an offer, prepare or abort names) "
                                         "that the wave's actions make as the controller sends them: the first death "
                                         "alone, the rest in one batch (signals.coalesce); "
                                         "wave_worker_calls_one_batch_per_death: each death's actions sent on their "
                                         "own, as before the batches",
}


class Round:
    """One round at `size` workers: each event's controller CPU seconds, and its observation count."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.group = FakeWorkerGroup(min_workers=max(1, size // 2), max_workers=size)
        self.cpu_s: dict[str, float] = {}
        self.observations: dict[str, int] = {}
        self.worker_calls = {"coalesced": 0, "one_batch_per_death": 0}  # the wave's
        self.step = 0

    def timed(self, event: str, observations: Iterable[Observation], after_s: float = 0.001) -> None:
        """Deliver `observations` and add their CPU to `event`'s. The caller builds them, from
        what the protocol did so far, before the clock starts."""
        batch = list(observations)
        began = time.process_time()
        actions = self.group.deliver(batch, after_s)
        self.cpu_s[event] = self.cpu_s.get(event, 0.0) + time.process_time() - began
        self.observations[event] = self.observations.get(event, 0) + len(batch)
        if event == "wave":
            self.worker_calls["coalesced"] += _worker_calls(coalesce(actions))
            self.worker_calls["one_batch_per_death"] += _worker_calls(actions)

    def commit_a_step(self) -> None:
        self.step += 1
        self.group.commit_step(self.step)

    def run(self) -> dict[str, float]:
        group, size = self.group, self.size
        self.timed("start", _ready(range(size)), READY_GAP_S)
        self.timed("start", group.formed_reports())
        self._check(size)
        self.commit_a_step()

        self.timed("heal", [death(1)])
        self.timed("heal", self._broken() + group.formed_reports(step=self.step))
        self._check(size - 1)
        self.commit_a_step()

        self.timed("grow", _ready([group.started[-1]]))
        prepare = max(group.prepares)
        self.timed("grow", [SwitchPrepared(w, prepare, self.step) for w in group.protocol.members])
        self.timed("grow", group.formed_reports(step=self.step))
        self._check(size)
        self.commit_a_step()

        count = max(1, int(size * WAVE_FRACTION))
        dying = group.protocol.members[1::size // count][:count]
        self.timed("wave", [death(dying[0])])
        self.timed("wave", [death(w) for w in dying[1:]], WAVE_WINDOW_S / count)
        self.timed("wave", self._broken() + group.formed_reports(step=self.step))
        self._check(size - count)

        self.cpu_s["replay"] = self._replay()
        return self.cpu_s

    def _broken(self) -> list[GroupBroken]:
        """Each survivor's report that the running generation's group broke under it."""
        protocol = self.group.protocol
        return [GroupBroken(w, protocol.running) for w in protocol.members]

    def _check(self, world_size: int) -> None:
        protocol = self.group.protocol
        if protocol.state.name != "RUNNING" or len(protocol.members) != world_size:
            raise RuntimeError(f"W={self.size}: expected RUNNING at {world_size} workers, the protocol is "
                               f"{protocol.state.name} at {len(protocol.members)}")

    def _replay(self) -> float:
        """CPU seconds of a restarted controller's path through this round's journal."""
        folder = tempfile.mkdtemp(prefix="scale-simulated-")
        try:
            storage = RunStorage(folder, "run")
            journal = EventJournal(storage)
            journal.emit("run_started", name="run", attempt=ATTEMPT)
            for action in self.group.actions:
                if isinstance(action, Emit):
                    journal.emit(action.type, **action.fields)
            journal.flush()
            old = self.group.protocol
            began = time.process_time()
            resumed = resume(read_events(storage), ATTEMPT)
            restarted = Protocol(old.scaling, old.failure, old.max_steps, generation=resumed.generation,
                                 failures=resumed.failures)
            spent = time.process_time() - began
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if not resumed.restarted or restarted.generation != old.generation:
            raise RuntimeError(f"W={self.size}: the replay resumed generation {restarted.generation}, "
                               f"not {old.generation}")
        return spent


def _worker_calls(actions: list[Action]) -> int:
    """The calls to workers that `actions` make: one per member named by an offer, prepare or abort."""
    calls = 0
    for action in actions:
        if isinstance(action, Offer):
            calls += len(action.formation.members)
        elif isinstance(action, Prepare):
            calls += len(action.members)
        elif isinstance(action, Abort):
            calls += len(action.workers)
    return calls


def _ready(worker_ids: Iterable[int]) -> list[Observation]:
    return [WorkerReady(w, node=f"node-{w}", pid=1000 + w) for w in worker_ids]


def main(sizes: tuple[int, ...] | None, rounds: int | None, out: str | None, argv: list[str] | None) -> int:
    sizes, rounds, out = sizes or SIZES, rounds or ROUNDS, out or DEFAULT_OUT
    started = time.time()
    measured: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
    counts: dict[int, dict[str, int]] = {}
    calls: dict[int, list[dict[str, int]]] = {size: [] for size in sizes}
    # Rounds outside, sizes inside: a burst of load on the machine hits every size alike.
    for round_index in range(rounds):
        for size in sizes:
            simulated = Round(size)
            cpu = simulated.run()
            measured[size].append(cpu)
            calls[size].append(simulated.worker_calls)
            counts[size] = simulated.observations
            print(f"[scale --simulated] W={size} round {round_index}: "
                  + ", ".join(f"{event} {seconds * 1e3:.1f} ms" for event, seconds in cpu.items()), flush=True)
    figures: dict[str, list[float | None]] = {}
    for size, runs in measured.items():
        for event in EVENTS:
            figures[f"scale_simulated.{size}.{event}_cpu_s"] = [run[event] for run in runs]
        figures[f"scale_simulated.{size}.replay_s"] = [run["replay"] for run in runs]
        figures[f"scale_simulated.{size}.wave_worker_calls"] = [run["coalesced"] for run in calls[size]]
        figures[f"scale_simulated.{size}.wave_worker_calls_one_batch_per_death"] = [
            run["one_batch_per_death"] for run in calls[size]]
    details: dict[str, Any] = {"scale_simulated_setup": {
        "sizes": list(sizes), "rounds": rounds, "wave_fraction": WAVE_FRACTION, "wave_window_s": WAVE_WINDOW_S,
        "observations": {str(size): count for size, count in counts.items()},
        "start_cpu_s": {str(size): sorted(run["start"] for run in runs) for size, runs in measured.items()},
        "cpu_count": os.cpu_count(),
    }}
    merge_figures(out, figures, details, DEFINITIONS, command_line("benchmarks.scale", argv), time.time() - started)
    print_medians(figures)
    print(f"\nwrote {out}")
    return 0
