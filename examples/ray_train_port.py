"""Ray Train's own PyTorch example (`ray/train/examples/pytorch/torch_fashion_mnist_example.py`,
Ray 2.60), ported to elastic by changing its imports, with its data synthesized instead of
downloaded.

    python examples/ray_train_port.py --storage-path /tmp/runs

The diff against Ray's script, all of it:
- `import ray.train` / `from ray.train import ScalingConfig` / `from ray.train.torch import
  TorchTrainer` become `import elastic` / `from elastic import ElasticTrainer, RunConfig,
  ScalingConfig`; `ray.train.torch.prepare_*` and `ray.train.report` become
  `elastic.prepare_*` and `elastic.report`, `ray.train.get_context()` `elastic.get_context()`;
- `ray.train.torch.enable_reproducibility()` becomes `torch.manual_seed(0)`: elastic syncs every
  rank's random streams itself;
- `TorchTrainer(...)` becomes `ElasticTrainer(...)`, with `ScalingConfig(num_workers=(1, 2))` so
  that a worker's death heals in place (and `spare_workers`, a warm spare that takes a dead
  worker's place at once); the global batch is the loader's batch size times the 2 workers, as
  in Ray Train, and stays so whatever the world size;
- FashionMNIST (60,000 + 10,000 images) becomes TRAIN_SAMPLES + TEST_SAMPLES noisy 28x28
  images of ten random class prototypes, and the `tqdm` bars go.
"""

from __future__ import annotations

import argparse
import time
from typing import Dict

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastic
from elastic import ElasticTrainer, RunConfig, ScalingConfig

TRAIN_SAMPLES, TEST_SAMPLES = 1024, 256
GLOBAL_BATCH_SIZE = 32  # Ray's example: 32, split over its 2 workers


def synthetic_fashion(samples: int, seed: int) -> TensorDataset:
    """Images of FashionMNIST's shape, learnable as its classes are: each of the 10 classes a fixed
    random picture (its prototype, the same in every split), each image its class's under noise."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    prototypes = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    images = prototypes[labels] + 2.0 * torch.randn(samples, 1, 28, 28, generator=generator)
    return TensorDataset(images, labels)


def get_dataloaders(batch_size):
    training_data = synthetic_fashion(TRAIN_SAMPLES, seed=0)
    test_data = synthetic_fashion(TEST_SAMPLES, seed=1)
    train_dataloader = DataLoader(training_data, batch_size=batch_size, shuffle=True)
    test_dataloader = DataLoader(test_data, batch_size=batch_size)
    return train_dataloader, test_dataloader


# Model Definition (Ray's, unchanged)
class NeuralNetwork(nn.Module):
    def __init__(self):
        super(NeuralNetwork, self).__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(512, 10),
            nn.ReLU(),
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits


def train_func_per_worker(config: Dict):
    torch.manual_seed(0)

    lr = config["lr"]
    epochs = config["epochs"]
    batch_size = config["batch_size_per_worker"]

    train_dataloader, test_dataloader = get_dataloaders(batch_size=batch_size)

    train_dataloader = elastic.prepare_data_loader(train_dataloader)
    test_dataloader = elastic.prepare_data_loader(test_dataloader)

    model = NeuralNetwork()
    model = elastic.prepare_model(model)

    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    for epoch in range(epochs):
        if elastic.get_context().get_world_size() > 1:
            train_dataloader.sampler.set_epoch(epoch)

        model.train()
        for X, y in train_dataloader:
            pred = model(X)
            loss = loss_fn(pred, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(config["sleep_s"])  # (not Ray's) a slower step, for a test's outside kill to land mid-epoch

        model.eval()
        test_loss, num_correct, num_total = 0, 0, 0
        with torch.no_grad():
            for X, y in test_dataloader:
                pred = model(X)
                loss = loss_fn(pred, y)

                test_loss += loss.item()
                num_total += y.shape[0]
                num_correct += (pred.argmax(1) == y).sum().item()

        test_loss /= len(test_dataloader)
        accuracy = num_correct / num_total

        elastic.report(metrics={"loss": test_loss, "accuracy": accuracy})


def train_fashion_mnist(storage_path: str, name: str = "fashion-mnist", epochs: int = 2, sleep_s: float = 0.0,
                        spare_workers: int = 0, show_progress: bool = True) -> elastic.Result:
    train_config = {"lr": 1e-3, "epochs": epochs, "batch_size_per_worker": GLOBAL_BATCH_SIZE // 2,
                    "sleep_s": sleep_s}
    trainer = ElasticTrainer(
        train_func_per_worker,
        train_loop_config=train_config,
        scaling_config=ScalingConfig(num_workers=(1, 2), spare_workers=spare_workers),
        run_config=RunConfig(name=name, storage_path=storage_path),
        show_progress=show_progress,
    )
    result = trainer.fit()
    print(f"Training result: step {result.step}, {result.metrics}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", required=True, help="local path or URI that holds the run folder")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--spare-workers", type=int, default=0)
    args = parser.parse_args()
    train_fashion_mnist(args.storage_path, epochs=args.epochs, spare_workers=args.spare_workers)
