"""elastic's ElasticTrainer on the benchmark workload: steady steps, and healing after a kill.

The train loop is the one in elastic/context.py's docstring. It stamps every committed step
with its generation and world size and returns the stamps; `Result.value` is what the lowest
surviving worker returned, so a killed rank never has to hand anything back.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

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


def _fit(config: dict[str, Any], steps: int, faults: list[elastic.Fault], storage: str) -> elastic.Result:
    trainer = elastic.ElasticTrainer(
        _train_loop,
        train_loop_config=config,
        scaling_config=elastic.ScalingConfig(min_workers=1, max_workers=workload.WORLD_SIZE),
        run_config=elastic.RunConfig(name=f"bench-{uuid.uuid4().hex[:8]}", storage_path=storage),
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
    stamps = []
    for step in ctx.steps(workload.make_dataset()):
        with step:
            for mb in step.micro_batches():
                loss = workload.loss_fn(model(mb.data[0]), mb.data[1])
                mb.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if not step.committed:
            continue  # a peer died mid-step; the context redoes the step in the healed generation
        # .item() in both variants, so the report call is the only difference between them.
        value = loss.item()
        if config["report"] and step.index >= workload.WARMUP_STEPS:
            elastic.report({"loss": value})
        stamps.append(workload.stamp(step.index, ctx.generation, step.world_size, time.time()))
    return stamps
