"""One system of the goodput benchmark, run until its process session is killed: elastic (with or
without a spare), Ray Train, or torchft (`benchmarks/goodput_torchft.py`).

    python -m benchmarks.goodput_systems <elastic|elastic_spare|ray_train|torchft> <out_dir>

`benchmarks/goodput.py` starts it in a session of its own, kills its workers while it runs,
and ends the session when the window is over; every training process records what it
committed in `out_dir` (`benchmarks/goodput_loop.py`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from benchmarks import goodput_loop as loop

# Enough logical CPUs for 4 workers, a spare and each system's controller, however few cores
# the machine has: the steps sleep most of their time.
RAY_CPUS = 8
ENDLESS_STEPS = 10**7
# Ray's docs leave how often to checkpoint to the user: 10 steps is 5 s of training, and each
# costs one report. elastic heals from live peers, and never restores from its checkpoints here.
RAY_TRAIN_CHECKPOINT_EVERY = 10
ELASTIC_CHECKPOINT_EVERY = 100


def elastic_loop(config: dict[str, Any]) -> None:
    import elastic

    torch.set_num_threads(1)
    ctx = elastic.get_context()
    model = ctx.prepare_model(loop.make_model())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=loop.LR))
    inputs, labels = loop.make_data()
    announced = False
    for step in ctx.steps(torch.utils.data.TensorDataset(inputs, labels)):
        with step:
            for mb in step.micro_batches():
                mb.backward(loop.loss_of(model, *mb.data))
            optimizer.step()
            optimizer.zero_grad()
        if not step.committed:
            continue
        if not announced:
            loop.announce(config["out_dir"])
            announced = True
        if ctx.rank == 0:
            probe = loop.probe_loss(model.module, inputs, labels) if step.index % loop.PROBE_EVERY == 0 else None
            loop.record(config["out_dir"], step.index, loop.GLOBAL_BATCH, probe)


def run_elastic(out_dir: str, spare: bool) -> None:
    import ray

    import elastic

    ray.init(num_cpus=RAY_CPUS, include_dashboard=False)
    elastic.ElasticTrainer(
        elastic_loop,
        train_loop_config={"out_dir": out_dir},
        scaling_config=elastic.ScalingConfig(min_workers=2, max_workers=loop.WORKERS, spare_workers=int(spare)),
        run_config=elastic.RunConfig(
            name="goodput", storage_path=os.path.join(out_dir, "runs"),
            checkpoint_config=elastic.CheckpointConfig(every_steps=ELASTIC_CHECKPOINT_EVERY),
        ),
        data_config=elastic.DataConfig(global_batch_size=loop.GLOBAL_BATCH, micro_batch_size=loop.SHARE,
                                       max_steps=ENDLESS_STEPS),
    ).fit()


def ray_train_loop(config: dict[str, Any]) -> None:
    import ray.train
    from ray.train.torch import prepare_model

    from benchmarks.ray_train import report_checkpoint, restore

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    model = prepare_model(loop.make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=loop.LR)
    inputs, labels = loop.make_data()
    first = restore(model, optimizer)
    loop.announce(config["out_dir"])
    for step in range(first, ENDLESS_STEPS):
        share = torch.tensor_split(loop.step_samples(step), world_size)[rank]
        loop.loss_of(model, inputs[share], labels[share]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            probe = loop.probe_loss(model.module, inputs, labels) if step % loop.PROBE_EVERY == 0 else None
            loop.record(config["out_dir"], step, loop.GLOBAL_BATCH, probe)
        if (step + 1) % RAY_TRAIN_CHECKPOINT_EVERY == 0:
            report_checkpoint(model, optimizer, step, rank, {"step": step})


def run_ray_train(out_dir: str) -> None:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=RAY_CPUS, include_dashboard=False)
    TorchTrainer(
        ray_train_loop,
        train_loop_config={"out_dir": out_dir},
        scaling_config=ray.train.ScalingConfig(num_workers=(2, loop.WORKERS)),
        run_config=ray.train.RunConfig(
            name="goodput", storage_path=os.path.join(out_dir, "ray-storage"),
            failure_config=ray.train.FailureConfig(max_failures=-1),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        ),
    ).fit()


def main(system: str, out_dir: str) -> None:
    if system in ("elastic", "elastic_spare"):
        run_elastic(out_dir, spare=system == "elastic_spare")
    elif system == "ray_train":
        run_ray_train(out_dir)
    elif system == "torchft":
        from benchmarks import goodput_torchft

        goodput_torchft.main(out_dir)
    else:
        raise SystemExit(f"unknown system {system!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
