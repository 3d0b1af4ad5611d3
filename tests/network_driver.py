"""Runs on a `NetworkCluster`: the driver the network tests run inside its head's namespace, and
the scenario they and benchmarks/partition.py share.

    python tests/network_driver.py <run.json>

`run.json` names the run (name, storage_path), its sizes (workers: [min, max]), the train
loop's config (`workloads.regression_loop`: max_steps, compute_s, sleep_s, gate, step_log), and
the FailureConfig's and the Strategy's fields; the driver fits it and saves the result (step, params, ledger) to
`out` with torch.save.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads  # noqa: E402
from elastic import (CheckpointConfig, DataConfig, ElasticTrainer, FailureConfig, RunConfig, ScalingConfig,  # noqa: E402
                     Strategy)
from elastic.checkpoint.storage import RunStorage  # noqa: E402
from elastic.journal.events import read_events  # noqa: E402

DRIVER = Path(__file__)
CUT_AT_STEP = 20  # training is held here until every worker started (a slow start takes a grow first)
RUN_TIMEOUT_S = 300.0
DATA_SEED = 3


@dataclass(frozen=True)
class Pace:
    compute_s: float  # a sleep inside each step, standing for its compute
    max_steps: int
    cut_after_s: float  # from the first generation of 3 to the cut: inside a step, past the first few
    hidden: int = 32  # the MLP's width: 512 makes each gradient all-reduce 74 KB, 4096 590 KB
    lr: float = 0.05  # SGD's: a wide MLP diverges at the default


FAST = Pace(compute_s=0.05, max_steps=30 * workloads.STEPS_PER_EPOCH, cut_after_s=0.4)  # 50 ms steps
SLOW = Pace(compute_s=1.0, max_steps=3 * workloads.STEPS_PER_EPOCH, cut_after_s=2.5)
SLOWEST = Pace(compute_s=3.0, max_steps=2 * workloads.STEPS_PER_EPOCH, cut_after_s=7.5)  # the 3 s steps
WIDE = Pace(compute_s=0.05, max_steps=10 * workloads.STEPS_PER_EPOCH, cut_after_s=0.4, hidden=512)
GROWING = Pace(compute_s=1.0, max_steps=6 * workloads.STEPS_PER_EPOCH, cut_after_s=2.5)  # room for a death and a grow
MEASURED = Pace(compute_s=0.3, max_steps=5 * workloads.STEPS_PER_EPOCH, cut_after_s=1.0)  # the failures issue's 0.3 s steps
# A step's all-reduce sends each rank's ring neighbour 786 KB: 63 ms at 100 Mbit/s, under 1 ms unshaped.
HEAVY = Pace(compute_s=0.05, max_steps=12 * workloads.STEPS_PER_EPOCH, cut_after_s=0.4, hidden=4096, lr=0.002)


@dataclass
class Cut:
    """What `cut_mid_step` saw: the outcome, the events, the first generation of 3, the victim, and
    when (this machine's clock) the link went down."""

    outcome: dict
    events: list[dict]
    first: dict
    victim: dict
    cut_at: float


def spawn(cluster, folder: Path, name: str, workers: tuple[int, int], pace: Pace, gate: Path | None = None,
          step_log: Path | None = None, failure: dict | None = None, hold: tuple[int, Path] | None = None,
          checkpoint_every: int | None = None, strategy: dict | None = None, loop_config: dict | None = None):
    """Start a driver on the cluster's head for a run of `regression_loop` (with `failure` as its
    FailureConfig's fields, held after step `hold[0]` until the file `hold[1]` exists, a checkpoint
    every `checkpoint_every` steps, `strategy` as its Strategy's fields, `loop_config` added to the
    loop's config); its Popen."""
    loop = {"max_steps": pace.max_steps, "compute_s": pace.compute_s, "sleep_s": 0.0, "hidden": pace.hidden,
            "lr": pace.lr, **(loop_config or {})}
    if gate:
        loop["gate"] = (CUT_AT_STEP, str(gate))
    if step_log:
        loop["step_log"] = str(step_log)
    if hold:
        loop["gates"] = [(hold[0], str(hold[1]))]
    run = {"name": name, "storage_path": str(folder), "workers": list(workers), "loop": loop,
           "out": str(folder / f"{name}.pt"), "failure": failure or {}, "checkpoint_every": checkpoint_every,
           "strategy": strategy or {}}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(run))
    log = open(folder / f"{name}.log", "w")
    return cluster.spawn_driver(DRIVER, [str(path)], stdout=log, stderr=log)


def result(driver, folder: Path, name: str) -> dict:
    driver.wait(RUN_TIMEOUT_S)
    if driver.returncode != 0:
        raise AssertionError(f"the driver failed: {(folder / f'{name}.log').read_text()[-3000:]}")
    return torch.load(folder / f"{name}.pt", weights_only=True)


def events(folder: Path, name: str) -> list[dict]:
    return read_events(RunStorage(str(folder), name))


def wait_for(folder: Path, name: str, condition, driver, timeout_s: float = RUN_TIMEOUT_S):
    """The first truthy `condition(events)` while the driver runs."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and driver.poll() is None:
        found = condition(events(folder, name))
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{name}: the run never got there: {(folder / f'{name}.log').read_text()[-3000:]}")


def node_of(event: dict, cluster) -> int:
    """The cluster node a worker started on, from the address it bound (`worker_started.binds`)."""
    address = re.search(r"\((198\.\d+\.\d+\.\d+)", event["binds"]).group(1)
    return next(node for node in range(cluster.nodes) if cluster.node_ip(node) == address)


def start_full(cluster, folder: Path, name: str, pace: Pace, step_log: Path | None = None, workers: int = 3,
               failure: dict | None = None, hold: tuple[int, Path] | None = None, checkpoint_every: int | None = None,
               strategy: dict | None = None, loop_config: dict | None = None):
    """A run of `workers` workers (min one fewer) once its first generation of all of them formed:
    (driver, that generation, the node of its last rank)."""
    gate = folder / f"{name}-every-worker-started"
    driver = spawn(cluster, folder, name, (workers - 1, workers), pace, gate=gate, step_log=step_log, failure=failure,
                   hold=hold, checkpoint_every=checkpoint_every, strategy=strategy, loop_config=loop_config)
    wait_for(folder, name, lambda found: len([e for e in found if e["type"] == "worker_started"]) >= workers, driver)
    gate.touch()
    first = wait_for(folder, name, lambda found: [e for e in found if e["type"] == "generation_formed"
                                                  and e["world_size"] == workers][-1:], driver)[0]
    started = {e["worker_id"]: e for e in events(folder, name) if e["type"] == "worker_started"}
    return driver, first, node_of(started[first["members"][-1]["worker_id"]], cluster)


def cut_mid_step(cluster, folder: Path, pace: Pace, step_log: Path | None = None, name: str = "cut",
                 workers: int = 3, checkpoint_every: int | None = None, strategy: dict | None = None) -> Cut:
    """A run of `workers` workers whose last rank's node is cut off inside a step, its link healed
    once the survivors healed."""
    driver, first, node = start_full(cluster, folder, name, pace, step_log, workers, checkpoint_every=checkpoint_every,
                                     strategy=strategy)
    time.sleep(pace.cut_after_s)
    cut_at = time.time()
    cluster.partition(node)
    wait_for(folder, name, lambda found: [e for e in found if e["type"] == "recovery"], driver)
    cluster.heal(node)  # the link comes back: the old worker must not come back with it
    outcome = result(driver, folder, name)
    return Cut(outcome, events(folder, name), first, first["members"][-1], cut_at)


def cut_partially(cluster, folder: Path, pace: Pace, step_log: Path | None = None, name: str = "partial") -> Cut:
    """A run of 3 workers whose rank 1's node stops reaching the nodes of ranks 0 and 2 inside a
    step, while every node still reaches the head (`NetworkCluster.cut`); mended once the
    survivors healed."""
    driver, first, _ = start_full(cluster, folder, name, pace, step_log)
    started = {e["worker_id"]: e for e in events(folder, name) if e["type"] == "worker_started"}
    nodes = [node_of(started[member["worker_id"]], cluster) for member in first["members"]]
    time.sleep(pace.cut_after_s)
    cut_at = time.time()
    for other in (nodes[0], nodes[2]):
        cluster.cut(nodes[1], other)
    wait_for(folder, name, lambda found: [e for e in found if e["type"] == "recovery"], driver)
    for other in (nodes[0], nodes[2]):
        cluster.mend(nodes[1], other)  # the links come back: the old worker must not come back with them
    outcome = result(driver, folder, name)
    return Cut(outcome, events(folder, name), first, first["members"][1], cut_at)


def main(path: str) -> None:
    ray.cloudpickle.register_pickle_by_value(workloads)
    run = json.loads(open(path).read())
    ray.init(log_to_driver=False)
    config = run["loop"]
    fitted = ElasticTrainer(
        workloads.regression_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(min_workers=run["workers"][0], max_workers=run["workers"][1]),
        run_config=RunConfig(
            name=run["name"], storage_path=run["storage_path"],
            checkpoint_config=CheckpointConfig(every_steps=run.get("checkpoint_every"), keep_last=2),
            failure_config=FailureConfig(**run.get("failure", {})),
        ),
        data_config=DataConfig(global_batch_size=workloads.GLOBAL_BATCH, micro_batch_size=16,
                               max_steps=config["max_steps"], seed=DATA_SEED),
        strategy=Strategy(**run.get("strategy", {})),
        show_progress=False,
    ).fit()
    torch.save({"step": fitted.step, "params": fitted.value["params"], "ledger": fitted.value["ledger"]}, run["out"])


if __name__ == "__main__":
    main(sys.argv[1])
