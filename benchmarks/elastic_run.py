"""elastic's ElasticTrainer on the benchmark workload: steady steps, and healing after a kill.

The train loop is the one in elastic/worker/context.py's docstring. It stamps every committed step
with its generation and world size (and, if asked, every step a peer's death failed) and
returns the stamps; `Result.value` is what the lowest surviving worker returned, so a killed
rank never has to hand anything back.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from typing import Any

import pyarrow.fs as pafs
import torch

import elastic
from benchmarks import workload


def steady(steps: int, report: bool, storage: str) -> list[dict[str, Any]]:
    """Train `steps` steps, with `elastic.report` after every step past the warm-up or never.

    Returns rank 0's step stamps. Reports start after the warm-up, as in the Ray Train run.
    """
    return _fit({"report": report}, steps, [], storage).value


def recovery(steps: int, kill_step: int, storage: str) -> dict[str, Any]:
    """Rank 1 dies at the start of `kill_step`; the survivor heals in place and goes on at world size 1.

    recovery_s runs from the survivor's completion of step kill_step-1 (the victim dies right
    after it) to the survivor's first step completed in the healed generation. steps_lost is
    the controller's count from its `recovery` event; steps_rolled_back counts committed steps
    redone, the way Ray Train's figure is counted.
    """
    result = _fit({"report": False}, steps, [elastic.Fault(kind="kill", rank=1, step=kill_step)], storage)
    stamps = result.value
    events = result.events_of("recovery")
    if not events:
        raise RuntimeError(f"the run reported no recovery event; its events: {[e['type'] for e in result.events]}")
    failed = next(s for s in stamps if s["step"] == kill_step - 1)
    healed = next(s for s in stamps if s["generation"] > failed["generation"])
    return {
        "recovery_s": healed["time"] - failed["time"],
        "steps_lost": events[0]["steps_lost"],
        "steps_rolled_back": kill_step - healed["step"],
        "recovery_event": events[0],
        "healed_world_size": healed["world_size"],
    }


def checkpoint(steps: int, every: int, storage: str) -> dict[str, Any]:
    """Checkpoints every `every` steps: the stall against a plain CPU copy of the same state,
    and the write throughput against a plain pyarrow.fs write of the same number of bytes.

    Elastic's writer fsyncs each file on a local disk, so the plain write is fsynced too. At
    this workload's 5 MB, fixed costs decide both figures; benchmarks/checkpoint_run.py
    measures them at 571 MB, with the copy timed on the workers.
    """
    result = _fit({"report": False}, steps, [], storage, checkpoint_every=every)
    saved = result.events_of("checkpoint_saved")
    stall_s = statistics.median(e["stall_s"] for e in saved)
    upload_s = statistics.median(e["upload_s"] for e in saved)
    size = saved[-1]["bytes"]
    model = workload.make_model()
    copies = []
    for _ in range(9):
        began = time.perf_counter()
        {name: tensor.clone() for name, tensor in model.state_dict().items()}
        copies.append(time.perf_counter() - began)
    data = os.urandom(size)
    folder = tempfile.mkdtemp(prefix="bench-plain-write-")
    writes = []
    for i in range(5):
        began = time.perf_counter()
        with pafs.LocalFileSystem().open_output_stream(f"{folder}/copy-{i}") as out:
            out.write(data)
        descriptor = os.open(f"{folder}/copy-{i}", os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)
        writes.append(time.perf_counter() - began)
    plain_copy_s, plain_write_s = statistics.median(copies), statistics.median(writes)
    return {
        "checkpoints": len(saved),
        "bytes": size,
        "stall_s": stall_s,
        "plain_copy_s": plain_copy_s,
        "stall_ratio_vs_plain_copy": stall_s / plain_copy_s,
        "write_mb_s": size / 1e6 / upload_s,
        "plain_write_mb_s": size / 1e6 / plain_write_s,
        "write_ratio_vs_plain_pyarrow": plain_write_s / upload_s,
    }


def hang(steps: int, hang_step: int, storage: str) -> dict[str, Any]:
    """Rank 1 hangs inside its all-reduce at `hang_step`; how long until the controller kills it."""
    failure = elastic.FailureConfig(hang_floor_s=1.0, hang_factor=20)
    result = _fit({"report": False}, steps, [elastic.Fault(kind="hang", rank=1, step=hang_step)], storage,
                  failure=failure)
    [hung] = [e for e in result.events_of("worker_failed") if e["kind"] == "hang"]
    gaps = workload.steady_gaps([s for s in result.value if s["step"] < hang_step])
    step_s = statistics.median(gaps) if gaps else None
    return {"hang_detect_s": hung["detect_s"], "deadline_s": hung["deadline_s"], "median_step_s": step_s,
            "detect_in_steps": hung["detect_s"] / step_s if step_s else None, "config": failure.model_dump()}


def chaos(steps: int, every_steps: int, storage: str) -> dict[str, Any]:
    """A kill of rank 0 every `every_steps` steps (about every 10 s here); the run's goodput."""
    faults = [elastic.Fault(kind="kill", rank=0, step=s) for s in range(every_steps, steps, every_steps)]
    result = _fit({"report": False}, steps, faults, storage, checkpoint_every=every_steps // 3,
                  failure=elastic.FailureConfig(max_failures=len(faults)))
    finished = result.events_of("run_finished")[-1]
    first_step = result.events_of("generation_formed")[0]["time"]
    productive_s = result.goodput * finished["wall_s"]
    return {
        "faults": len(faults),
        "recoveries": [{k: e[k] for k in ("seconds", "steps_lost", "from_checkpoint")} for e in result.events_of("recovery")],
        "wall_s": finished["wall_s"],
        "goodput": productive_s / (finished["time"] - first_step),
        "goodput_including_startup": result.goodput,
        "seconds_between_faults": (finished["time"] - first_step) / (len(faults) + 1),
    }


def _fit(config: dict[str, Any], steps: int, faults: list[elastic.Fault], storage: str,
         checkpoint_every: int | None = None, failure: elastic.FailureConfig | None = None,
         spare_workers: int = 0, scaling: elastic.ScalingConfig | None = None) -> elastic.Result:
    """The benchmark workload through `ElasticTrainer`, at 1 to workload.WORLD_SIZE workers unless `scaling` says otherwise."""
    trainer = elastic.ElasticTrainer(
        _train_loop,
        train_loop_config=config,
        scaling_config=scaling or elastic.ScalingConfig(min_workers=1, max_workers=workload.WORLD_SIZE,
                                                        spare_workers=spare_workers),
        run_config=elastic.RunConfig(
            name=f"bench-{uuid.uuid4().hex[:8]}", storage_path=storage,
            checkpoint_config=elastic.CheckpointConfig(every_steps=checkpoint_every),
            failure_config=failure or elastic.FailureConfig(),
        ),
        data_config=elastic.DataConfig(
            global_batch_size=workload.GLOBAL_BATCH, micro_batch_size=workload.MICRO_BATCH, max_steps=steps,
            seed=workload.SEED,
        ),
        faults=faults,
        show_progress=False,
    )
    return trainer.fit()


def _train_loop(config: dict[str, Any]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    ctx = elastic.get_context()
    model = ctx.prepare_model(workload.make_model())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=workload.LR))
    # A sleep per step stands for compute that dwarfs the model's (benchmarks/protocol_run.py);
    # it comes before the backward, so a rank killed inside the all-reduce finds its peers there.
    sleep_s = config.get("step_sleep_s", 0.0)
    stamps = []
    for step in ctx.steps(workload.make_dataset()):
        with step:
            if sleep_s:
                time.sleep(sleep_s)
            for mb in step.micro_batches():
                loss = workload.loss_fn(model(mb.data[0]), mb.data[1])
                mb.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if not step.committed:
            # A peer died mid-step; the context redoes the step in the healed generation.
            if config.get("stamp_failures"):
                stamps.append({**workload.stamp(step.index, ctx.generation, step.world_size, time.time()),
                               "failed": True})
            continue
        # .item() in both variants, so the report call is the only difference between them.
        value = loss.item()
        if config["report"] and step.index >= workload.WARMUP_STEPS:
            elastic.report({"loss": value})
        stamps.append(workload.stamp(step.index, ctx.generation, step.world_size, time.time()))
    return stamps
