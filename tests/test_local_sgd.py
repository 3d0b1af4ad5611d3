"""EASGD's sync (`elastic.techniques.local_sgd.OuterSync`) against the paper's arithmetic, in two real gloo
processes, no Ray; and the model a checkpoint takes from it, in one process.

Each rank moves its parameters away from the shared initial model by its own known amount,
so either rank can compute what every rank holds and check the sync's result within 1e-12
(float64): d_i = alpha (x_i - c), x_i -= d_i, c += d_0 + d_1; the last sync leaves every rank
at the center.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.techniques.local_sgd import OuterSync
from gloo_processes import client, join, spawn

pytestmark = pytest.mark.timeout(120)
ALPHA = 0.3
EVERY, MAX_STEPS = 4, 8
TOLERANCE = 1e-12


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _moved(params: list[torch.Tensor], rank: int, interval: int) -> list[torch.Tensor]:
    """What rank `rank` steps `params` to in interval `interval`: its own, known drift."""
    generator = torch.Generator().manual_seed(100 * interval + rank)
    return [p + torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]


def _two_ranks(rank, port, results):
    join(client(port), 0, rank, 2)
    model = _mlp()
    outer = OuterSync({"kind": "easgd", "every": EVERY, "alpha": ALPHA}, model, MAX_STEPS)
    center = [p.detach().clone() for p in model.parameters()]  # the center starts as the model
    ranks = [center, center]
    errors, differ = [], []
    for interval, step in enumerate(range(EVERY, MAX_STEPS + 1, EVERY)):
        ranks = [_moved(ranks[r], r, interval) for r in (0, 1)]
        with torch.no_grad():
            for param, value in zip(model.parameters(), ranks[rank]):
                param.copy_(value)
        outer.sync(step)
        pulls = [[ALPHA * (x - c) for x, c in zip(ranks[r], center)] for r in (0, 1)]
        ranks = [[x - d for x, d in zip(ranks[r], pulls[r])] for r in (0, 1)]
        center = [c + d0 + d1 for c, d0, d1 in zip(center, *pulls)]
        if step == MAX_STEPS:
            ranks = [center, center]
        errors += [(p - x).abs().max().item() for p, x in zip(model.parameters(), ranks[rank])]
        errors += [(a - c).abs().max().item() for a, c in zip(outer.anchor, center)]
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        both = [torch.empty_like(mine) for _ in (0, 1)]
        dist.all_gather(both, mine)
        differ.append(not torch.equal(*both))  # what the ranks hold, not what the test expects
    results[rank] = {"error": max(errors), "differ": differ, "bytes_sent": outer.bytes_sent, "syncs": outer.syncs,
                     "numel": sum(p.numel() for p in model.parameters())}
    dist.destroy_process_group()


def test_an_easgd_sync_pulls_ranks_and_center_together_and_the_last_leaves_every_rank_at_the_center():
    results = spawn(_two_ranks, nprocs=2)
    for rank in (0, 1):
        outcome = results[rank]
        assert outcome["error"] <= TOLERANCE, outcome
        # Between syncs the ranks keep their own parameters; after the last they share the center.
        assert outcome["differ"] == [True, False], outcome
        assert outcome["syncs"] == 2 and outcome["bytes_sent"] == 2 * outcome["numel"] * 8, outcome


def test_an_easgd_checkpoint_takes_the_center_for_every_key_of_a_tied_parameter_and_keeps_buffers():
    shared = nn.Linear(3, 3).double()
    model = nn.Sequential(shared, nn.BatchNorm1d(3).double(), shared)  # one weight under two keys
    outer = OuterSync({"kind": "easgd", "every": EVERY, "alpha": ALPHA}, model, MAX_STEPS)
    center = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # the rank's own parameters, away from the center
        model[1].running_mean.add_(5.0)
    written = outer.model_to_checkpoint(model.state_dict(), outer.state_dict())
    for key in ("0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"):
        assert torch.equal(written[key], center[key]), key
    assert torch.equal(written["1.running_mean"], model[1].running_mean), "a buffer is the rank's, not the center's"
