"""Train loops shared by the integration tests.

`regression_loop` trains a float64 MLP on a fixed regression set and keeps a per-sample ledger
as synced state: each committed step all-reduces the count of every sample its ranks
processed and adds it to the row of the step's epoch. At the first step of every generation
it checks that all ranks hold bit-identical model, optimizer and ledger state, and raises if
not, which fails the run.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.distributed as dist

import elastic

NUM_SAMPLES = 512
GLOBAL_BATCH = 64
STEPS_PER_EPOCH = NUM_SAMPLES // GLOBAL_BATCH


def regression_data(num_samples: int = NUM_SAMPLES) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, 16, generator=generator, dtype=torch.float64)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * x[:, 4:5]
    return torch.utils.data.TensorDataset(x, y)


def build_mlp(hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)).double()


def state_digest(*objects) -> str:
    digest = hashlib.sha256()
    for obj in objects:
        state = obj.state_dict() if hasattr(obj, "state_dict") else {"t": obj}
        for tensor in _tensors(state):
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def regression_loop(config: dict) -> dict:
    ctx = elastic.get_context()
    dataset = regression_data(config.get("num_samples", NUM_SAMPLES))
    model = ctx.prepare_model(build_mlp(config.get("hidden", 32)))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    epochs = -(-config["max_steps"] // STEPS_PER_EPOCH)
    ledger = torch.zeros(epochs, NUM_SAMPLES, dtype=torch.float64)
    ctx.register_state("ledger", ledger)
    checked: list[int] = []
    for step in ctx.steps(dataset):
        with step:
            if not checked or checked[-1] != ctx.generation:
                digests = [None] * ctx.world_size
                dist.all_gather_object(digests, state_digest(model.module, optimizer, ledger))
                if len(set(digests)) != 1:
                    raise AssertionError(f"ranks differ after generation {ctx.generation} formed: {digests}")
                checked.append(ctx.generation)
            time.sleep(config.get("compute_s", 0.0))  # a slow step's compute, inside the step
            if step.index == config.get("mismatch_at"):
                dist.all_reduce(torch.ones(1 + ctx.rank))  # a user bug: shapes differ across ranks
            counts = torch.zeros(NUM_SAMPLES, dtype=torch.float64)
            for mb in step.micro_batches():
                x, y = mb.data
                counts[mb.indices] += 1
                loss = torch.nn.functional.mse_loss(model(x), y)
                mb.backward(loss)
            dist.all_reduce(counts)
            optimizer.step()
            optimizer.zero_grad()
            ledger[step.cursor.epoch] += counts
        bad_rank, bad_step = config.get("raise_from", (-1, 0))
        if ctx.rank == bad_rank and step.index >= bad_step:
            raise ValueError(f"injected user error on rank {ctx.rank} at step {step.index}")
        elastic.report({"loss": loss.item()})
        time.sleep(config.get("sleep_s", 0.0))
        gate_step, gate_file = config.get("gate", (-1, ""))
        while step.index == gate_step and not os.path.exists(gate_file):
            time.sleep(0.01)  # held until the test opens the gate: a state of the run it waits for
    return {
        "params": {k: v.clone() for k, v in model.module.state_dict().items()},
        "ledger": ledger.clone(),
        "checked": checked,
        "pid": os.getpid(),
    }
