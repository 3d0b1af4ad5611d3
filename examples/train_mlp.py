"""The smallest elastic program: an MLP fits a noisy linear map on 1-2 workers.

    python examples/train_mlp.py
"""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import elastic
from elastic import DataConfig, ElasticTrainer, RunConfig, ScalingConfig


def make_dataset() -> TensorDataset:
    # Seeded, so every worker builds the same samples without any shared storage.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=generator)
    y = x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(4096, 1, generator=generator)
    return TensorDataset(x, y)


def train_loop():
    ctx = elastic.get_context()
    model = ctx.prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    for step in ctx.steps(make_dataset()):
        with step:
            for mb in step.micro_batches():
                x, y = mb.data
                loss = F.mse_loss(model(x), y)
                mb.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step.committed:
            elastic.report({"loss": loss.item()})


if __name__ == "__main__":
    trainer = ElasticTrainer(
        train_loop,
        scaling_config=ScalingConfig(min_workers=1, max_workers=2),
        run_config=RunConfig(name="train_mlp", storage_path="./runs"),
        data_config=DataConfig(global_batch_size=64, micro_batch_size=32, max_steps=200),
    )
    result = trainer.fit()
    print(f"{result.step} steps, final loss {result.metrics['loss']:.4f}")
