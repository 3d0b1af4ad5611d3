"""Ray Train's TorchTrainer on the benchmark workload: steady steps, and recovery from a kill.

Ray Train restarts the whole worker group after a worker dies and resumes from the latest
reported checkpoint, so the recovery run checkpoints (rank 0 saves, every rank reports) every
`checkpoint_every` steps, and records each step as it completes in a per-process file: a
killed process cannot return anything.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from typing import Any

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer, prepare_model

from benchmarks import workload


def steady(steps: int, report: bool, storage: str) -> list[dict[str, Any]]:
    """Train `steps` steps, with `ray.train.report` after every step past the warm-up or never.

    Returns rank 0's step stamps. Reports start after the warm-up because each one waits for
    the controller's next poll of the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): steps
    spent warming up at that pace would only stretch the run.
    """
    out_dir = tempfile.mkdtemp(prefix="stamps-", dir=storage)
    config = {"steps": steps, "report": report, "out_dir": out_dir}
    _fit(_steady_loop, config, storage, f"steady-report-{report}", max_failures=0)
    with open(os.path.join(out_dir, "rank0.json")) as f:
        return json.load(f)


def recovery(steps: int, kill_step: int, checkpoint_every: int, storage: str) -> dict[str, Any]:
    """Rank 1 dies at the start of `kill_step`; Ray Train restarts the group from the last checkpoint.

    recovery_s runs from rank 0's completion of step kill_step-1 (the victim dies right after
    it) to the first step completed after the restart. steps_lost counts the completed steps
    the restart rolled back, i.e. redid: those since the last checkpoint the controller had
    registered, which it does at its next poll of the workers after the report.
    """
    out_dir = tempfile.mkdtemp(prefix="stamps-", dir=storage)
    config = {
        "steps": steps,
        "kill_step": kill_step,
        "checkpoint_every": checkpoint_every,
        "out_dir": out_dir,
        "marker": os.path.join(out_dir, "killed"),
    }
    _fit(_recovery_loop, config, storage, "recovery", max_failures=1)
    stamps = []
    for path in glob.glob(os.path.join(out_dir, "stamps-rank0-*.jsonl")):
        with open(path) as f:
            stamps.extend(json.loads(line) for line in f if line.strip())
    stamps.sort(key=lambda s: s["time"])
    before = [s for s in stamps if s["generation"] == 0]
    after = [s for s in stamps if s["generation"] == 1]
    if not after:
        raise RuntimeError("Ray Train never completed a step after the injected kill")
    failed_at = next(s for s in before if s["step"] == kill_step - 1)["time"]
    return {
        "recovery_s": after[0]["time"] - failed_at,
        "steps_lost": kill_step - after[0]["step"],
        "resumed_at_step": after[0]["step"],
        "checkpoint_every": checkpoint_every,
    }


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the latest checkpoint Ray Train hands this worker, if any, into the DDP `model` and
    `optimizer`: the step to start from."""
    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return 0
    with checkpoint.as_directory() as path:
        state = torch.load(os.path.join(path, "state.pt"))
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"] + 1


def report_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int,
                      metrics: dict[str, Any]) -> None:
    """Report `metrics` with a checkpoint of step `step` that rank 0 saves, as Ray Train's docs do."""
    with tempfile.TemporaryDirectory() as path:
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       os.path.join(path, "state.pt"))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(path) if rank == 0 else None)


def _fit(loop: Any, config: dict[str, Any], storage: str, name: str, max_failures: int) -> None:
    trainer = TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=workload.WORLD_SIZE),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        ),
    )
    trainer.fit()


def _setup() -> tuple[int, torch.nn.Module, torch.optim.Optimizer]:
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    model = prepare_model(workload.make_model())
    return rank, model, torch.optim.SGD(model.parameters(), lr=workload.LR)


def _steady_loop(config: dict[str, Any]) -> None:
    rank, model, optimizer = _setup()
    stamps = []

    def after_step(step: int, loss: torch.Tensor) -> None:
        value = loss.item()
        if config["report"] and step >= workload.WARMUP_STEPS:
            ray.train.report({"loss": value})
        stamps.append(workload.stamp(step, 0, workload.WORLD_SIZE, time.time()))

    workload.train_steps(model, optimizer, workload.make_dataset(), rank, workload.WORLD_SIZE, 0, config["steps"],
                         after_step)
    if rank == 0:
        with open(os.path.join(config["out_dir"], "rank0.json"), "w") as f:
            json.dump(stamps, f)


def _recovery_loop(config: dict[str, Any]) -> None:
    rank, model, optimizer = _setup()
    # The victim leaves the marker behind, so its presence tells a restarted group from the first.
    generation = int(os.path.exists(config["marker"]))
    first_step = restore(model, optimizer)
    log = open(os.path.join(config["out_dir"], f"stamps-rank{rank}-{os.getpid()}.jsonl"), "a")

    def after_step(step: int, loss: torch.Tensor) -> None:
        metrics = {"loss": loss.item(), "step": step}
        if (step + 1) % config["checkpoint_every"] == 0:
            report_checkpoint(model, optimizer, step, rank, metrics)
        log.write(json.dumps(workload.stamp(step, generation, workload.WORLD_SIZE, time.time())) + "\n")
        log.flush()
        if rank == 1 and step + 1 == config["kill_step"] and generation == 0:
            open(config["marker"], "w").close()
            os._exit(1)

    workload.train_steps(model, optimizer, workload.make_dataset(), rank, workload.WORLD_SIZE, first_step,
                         config["steps"], after_step)
    log.close()
