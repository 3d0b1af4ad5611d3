"""What a death inside a heal's connect costs, with the connect deadline the controller derives
from the last connect beside the fixed 3 s deadline it replaced.

    .venv/bin/python -m benchmarks.connect_death               # 3 rounds, about 5 minutes
    .venv/bin/python -m benchmarks.connect_death --rounds 1 --out /tmp/connect.json

Each run is the chaos matrix's "heal-connect" cell (tests/test_chaos_matrix.py): `regression_loop`
on 3 workers (min 1), ~5 ms steps; at step 12 rank 2 dies at the step's start, and in the heal
that follows rank 1 dies past the barrier's "go", before it connects
(`Fault(kind="kill", rank=1, step=12, where="connect")`). Rank 0 then waits in gloo's connect for
rank 1's address until the offer's connect deadline, and joins the next offer. Two settings, run
alternately in each round:

- derived: `FailureConfig()` (`connect_floor_s=0.1`): 4 times the last connect, at least 0.1 s;
- fixed: `FailureConfig(connect_floor_s=3.0)`: 3 s whatever the connects took, as before.

Figures, each a median over the rounds with min, median and max under `spread.<key>`:

- death_inside_connect_recovery_s: from rank 1's death (its `fault_injected` event, recorded just
  before it exits) to the commit of the generation that healed around it (the controller's
  `recovery` event), with the derived deadline;
- death_inside_connect_fixed_deadline_s: the same with the fixed 3 s deadline.

A survivor that listens for the dead member's connection after its address was published waits
5 times the deadline in gloo (0.51 s at 0.1 s, 15 s at 3 s; docs/architecture.md): this run
measures the other half of the window, the wait for the address, which a fault can hit every time.
The keys are merged into benchmarks/results/bench.json (or --out), keeping the others.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import ray

import elastic
from benchmarks.bench import command_line, merge_figures, parse_rounds, print_medians

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import workloads  # noqa: E402
from workloads import GLOBAL_BATCH, STEPS_PER_EPOCH, fit_held, regression_loop, workers_started  # noqa: E402

# Ray workers cannot import the tests folder: the train loop goes by value, as in the tests.
ray.cloudpickle.register_pickle_by_value(workloads)

STEPS = 20 * STEPS_PER_EPOCH
DEATH_STEP = 12
SETTINGS = {"derived": elastic.FailureConfig(), "fixed": elastic.FailureConfig(connect_floor_s=3.0)}


def connect_death(folder: Path, name: str, failure: elastic.FailureConfig) -> float:
    """One run; seconds from the death inside the heal's connect to the commit healed around it."""
    gate = folder / f"{name}-started"
    connect = elastic.Fault(kind="kill", rank=1, step=DEATH_STEP, where="connect")
    trainer = elastic.ElasticTrainer(
        regression_loop,
        train_loop_config={"max_steps": STEPS, "sleep_s": 0.005, "gate": (0, str(gate))},
        scaling_config=elastic.ScalingConfig(min_workers=1, max_workers=3),
        run_config=elastic.RunConfig(name=name, storage_path=str(folder), failure_config=failure),
        data_config=elastic.DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=16, max_steps=STEPS),
        faults=[elastic.Fault(kind="kill", rank=2, step=DEATH_STEP), connect],
        show_progress=False,
    )
    result = fit_held(trainer, workers_started(3))
    [death] = [e["time"] for e in result.events_of("fault_injected") if e["fault"] == connect.spec()]
    healed = [e["time"] for e in result.events_of("recovery") if e["time"] > death]
    if not healed:
        raise RuntimeError(f"no heal after the death inside the connect; generations: "
                           f"{[(e['generation'], e['world_size'], e['kind']) for e in result.events_of('generation_formed')]}")
    return healed[0] - death


def main(argv: list[str] | None = None) -> int:
    _, args = parse_rounds(__doc__, argv)
    started = time.time()
    figures: dict[str, list[float | None]] = {"death_inside_connect_recovery_s": [],
                                              "death_inside_connect_fixed_deadline_s": []}
    keys = {"derived": "death_inside_connect_recovery_s", "fixed": "death_inside_connect_fixed_deadline_s"}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="elastic-connect-") as storage:
        for round_index in range(args.rounds):
            order = list(SETTINGS) if round_index % 2 == 0 else list(reversed(SETTINGS))
            for label in order:
                seconds = connect_death(Path(storage), f"connect-{label}-{round_index}", SETTINGS[label])
                figures[keys[label]].append(seconds)
                print(f"round {round_index + 1}/{args.rounds} {label}: {seconds:.3f} s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    ray.shutdown()
    merge_figures(args.out, figures, {}, {
        "death_inside_connect_recovery_s": "rank 1 dies past the barrier of the heal after rank 2's death, before it "
                                           "connects: seconds from its death to the commit of the generation healed "
                                           "around it, with the connect deadline derived from the last connect "
                                           "(benchmarks/connect_death.py)",
        "death_inside_connect_fixed_deadline_s": "the same with the fixed 3 s connect deadline it replaced "
                                                 "(FailureConfig(connect_floor_s=3.0))",
    }, command_line("benchmarks.connect_death", argv), time.time() - started)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
