"""The one workload every system in the benchmark trains, and the arithmetic on its timings.

An MLP 256 -> 1024 -> 1024 -> 10 with ReLU, SGD at lr 0.01, a global batch of 128 split
evenly over the ranks, on synthetic data drawn from a fixed seed. The plain-DDP and Ray Train
loops take their samples the way elastic's data cursor does (a seeded order per epoch, rank r
reads a contiguous share of each global batch; elastic's order is block-wise, at the same
cost per step), so that the systems differ only in what wraps the step.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

IN_FEATURES = 256
HIDDEN = 1024
CLASSES = 10
GLOBAL_BATCH = 128
MICRO_BATCH = 64
WORLD_SIZE = 2
LR = 0.01
NUM_SAMPLES = 8192
SEED = 0
# The first steps pay for allocator growth, thread pools and connection set-up.
WARMUP_STEPS = 20


def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (NUM_SAMPLES,), generator=generator)
    return TensorDataset(inputs, labels)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


@functools.lru_cache(maxsize=1)
def _epoch_order(epoch: int) -> torch.Tensor:
    return torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))


def rank_indices(step: int, world_size: int, rank: int) -> torch.Tensor:
    """Sample indices of rank's share of global step `step`: a seeded permutation per epoch,
    contiguous shares of each global batch (elastic's own order is block-wise, with the same cost)."""
    epoch, within = divmod(step, NUM_SAMPLES // GLOBAL_BATCH)
    share = GLOBAL_BATCH // world_size
    start = within * GLOBAL_BATCH + rank * share
    return _epoch_order(epoch)[start : start + share]


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: TensorDataset,
    rank: int,
    world_size: int,
    first_step: int,
    last_step: int,
    after_step: Callable[[int, torch.Tensor], None],
) -> None:
    """The DDP loop shared by plain torch and Ray Train; `after_step(step, loss)` runs after each step."""
    inputs, labels = dataset.tensors
    for step in range(first_step, last_step):
        indices = rank_indices(step, world_size, rank)
        loss = loss_fn(model(inputs[indices]), labels[indices])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after_step(step, loss)


def steady_gaps(stamps: Sequence[dict[str, Any]], warmup: int = WARMUP_STEPS,
                world_size: int = WORLD_SIZE) -> list[float]:
    """Gaps between consecutive step completions at full world size, past each warm-up.

    `stamps` are one rank's `{"step", "time", "generation", "world_size"}` records in order.
    A gap counts only when both steps ran in the same generation of `world_size` ranks and the
    later one is at least `warmup` steps into that generation, so a slow start or a rescale
    never leaks into the steady figure.
    """
    gaps = []
    since_start = 0
    for before, after in zip(stamps, stamps[1:]):
        same = before["generation"] == after["generation"] and after["step"] == before["step"] + 1
        since_start = since_start + 1 if same else 0
        if same and after["world_size"] == world_size and since_start >= warmup:
            gaps.append(after["time"] - before["time"])
    return gaps


def train_elastic(ctx: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Any) -> float | None:
    """The elastic loop over `ctx.steps(dataset)`; the median steady step time (`steady_gaps`)."""
    stamps = []
    for step in ctx.steps(dataset):
        with step:
            for mb in step.micro_batches():
                inputs, labels = mb.data
                mb.backward(loss_fn(model(inputs), labels))
            optimizer.step()
            optimizer.zero_grad()
        if step.committed:
            stamps.append(stamp(step.index, ctx.generation, ctx.world_size, time.perf_counter()))
    gaps = steady_gaps(stamps)
    return statistics.median(gaps) if gaps else None


def stamp(step: int, generation: int, world_size: int, time_s: float) -> dict[str, Any]:
    return {"step": step, "generation": generation, "world_size": world_size, "time": time_s}
