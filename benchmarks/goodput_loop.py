"""The work every system trains in the goodput benchmark, and what its processes leave behind.

The model is a float64 Tanh MLP (256 -> 256 -> 10) trained with SGD on a global batch of 128
synthetic samples. Its forward is padded with a sleep of COMPUTE_PAD_S per share of the
global batch at WORKERS workers (32 samples), in proportion to the samples it computes,
standing in for a larger model's compute, so that one step takes about STEP_S: four workers of real 0.5 s
compute cannot run side by side on this machine's two cores, and a sleep stretches every
system's step alike. float64 and Tanh so that elastic's run through failures can be compared
with its fault-free run step for step (a flipped ReLU unit would turn 1e-12 into 1e-2).

Every training process of every system calls `announce(out_dir)` once it trains (the killer
picks its victims among the announced processes still alive) and `record(...)` after each
step it committed. A record names the step, when it committed, the samples the whole step
trained, and on the step's first rank every PROBE_EVERY steps the loss on a fixed probe batch,
a function of the parameters alone.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

IN_FEATURES = 256
HIDDEN = 256
CLASSES = 10
GLOBAL_BATCH = 128
WORKERS = 4
SHARE = GLOBAL_BATCH // WORKERS
LR = 0.05
NUM_SAMPLES = 16384
SEED = 0
STEP_S = 0.5
COMPUTE_PAD_S = 0.45
PROBE_EVERY = 10
PROBE_SAMPLES = 256


def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES),
    ).double()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=generator, dtype=torch.float64)
    # Labels a linear teacher gives, so the loss falls.
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=generator, dtype=torch.float64)
    return inputs, (inputs @ teacher).argmax(dim=1)


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean loss of a batch, after the pad that stands in for a larger model's compute on it
    (a system that keeps the global batch at fewer workers computes more per worker)."""
    time.sleep(COMPUTE_PAD_S * len(inputs) / SHARE)
    return F.cross_entropy(model(inputs), labels)


def probe_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """The loss on the first PROBE_SAMPLES samples: the same parameters give the same number."""
    with torch.no_grad():
        return F.cross_entropy(model(inputs[:PROBE_SAMPLES]), labels[:PROBE_SAMPLES]).item()


def announce(out_dir: str) -> None:
    """Name this process as a training worker the killer may pick."""
    open(os.path.join(out_dir, f"worker-{os.getpid()}"), "w").close()


def record(out_dir: str, step: int, samples: int, probe: float | None = None) -> None:
    """Write down that `step` committed now, training `samples` samples across every rank."""
    entry: dict[str, Any] = {"step": step, "t": time.time(), "samples": samples, "pid": os.getpid()}
    if probe is not None:
        entry["probe"] = probe
    with open(os.path.join(out_dir, f"stamps-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def announced(out_dir: str) -> list[int]:
    """The processes that announced themselves, alive or not."""
    return sorted(int(path.rsplit("-", 1)[1]) for path in glob.glob(os.path.join(out_dir, "worker-*")))


def read_stamps(out_dir: str) -> list[dict[str, Any]]:
    """Every record of every process, in the order they committed."""
    stamps = []
    for path in glob.glob(os.path.join(out_dir, "stamps-*.jsonl")):
        with open(path) as f:
            # A process killed mid-write leaves a partial last line.
            for line in f:
                try:
                    stamps.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return sorted(stamps, key=lambda s: s["t"])


def step_samples(step: int) -> torch.Tensor:
    """The GLOBAL_BATCH sample indices of global step `step`: a seeded permutation per epoch. Rank r
    of w trains `torch.tensor_split(step_samples(step), w)[r]` (elastic draws its own, exactly once)."""
    epoch, within = divmod(step, NUM_SAMPLES // GLOBAL_BATCH)
    return _epoch_order(epoch)[within * GLOBAL_BATCH:(within + 1) * GLOBAL_BATCH]


@functools.lru_cache(maxsize=1)
def _epoch_order(epoch: int) -> torch.Tensor:
    return torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
