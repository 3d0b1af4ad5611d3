"""ZeRO-2 and ZeRO-3 on FSDP2 with live resharding (`elastic.techniques.fsdp`) against one plain model and
AdamW on the whole batch, in real processes on gloo, no Ray.

Each rank trains on its share of the batch; FSDP2 reduce-scatters the gradients' mean, which is
the whole batch's gradient when the shares are equal. After every step the gathered parameters
and optimizer state must equal the plain run's within 1e-9 (float64, Tanh), through a grow
2->3 (the newcomer gets its shards point to point), a death 3->2 (the dead rank's shards come
from its buddy copy) and a checkpoint written at 3 that resumes at 2.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.errors import ElasticError
from elastic.techniques.fsdp import FullyShardedModel
from elastic.techniques.zero import ShardedOptimizer
from gloo_processes import client, join, spawn

pytestmark = pytest.mark.timeout(180)
TOLERANCE = 1e-9
STEPS = 3
BATCH = 12  # splits evenly over 2 and 3 ranks


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5), nn.Tanh(), nn.Linear(5, 1)).double()


class _Run:
    """A model under FullyShardedModel and a plain copy stepped on the whole batch."""

    def __init__(self, stage: int, replicas: int = 1) -> None:
        model = self.given = _mlp()
        self.reference = copy.deepcopy(model)
        self.plain = torch.optim.AdamW(self.reference.parameters(), lr=1e-2, weight_decay=0.1)
        self.sharded = FullyShardedModel(model, stage=stage, replicas=replicas)
        self.optimizer = self.sharded.adopt(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        self.steps, self.error, self.checks = 0, 0.0, 0

    def step(self) -> None:
        generator = torch.Generator().manual_seed(self.steps)
        x = torch.randn(BATCH, 8, generator=generator, dtype=torch.float64)
        y = torch.randn(BATCH, 1, generator=generator, dtype=torch.float64)
        size, rank = dist.get_world_size(), dist.get_rank()
        share = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        self.optimizer.zero_grad()
        nn.functional.mse_loss(self.sharded.module(x[share]), y[share]).backward()
        self.optimizer.step()
        self.plain.zero_grad()
        nn.functional.mse_loss(self.reference(x), y).backward()
        self.plain.step()
        self.steps += 1
        self.check()

    def check(self) -> None:
        """Gather the shards (a collective) and fold their distance from the plain run into `error`."""
        for param, twin in zip(self.sharded._params, self.reference.parameters()):
            self.error = max(self.error, (param.full_tensor() - twin).abs().max().item())
            state, plain = self.optimizer.inner.state.get(param, {}), self.plain.state.get(twin, {})
            for name in ("exp_avg", "exp_avg_sq"):
                if name in plain:
                    self.error = max(self.error, (state[name].full_tensor() - plain[name]).abs().max().item())
        self.checks += 1

    def sync_reference_from_rank_0(self) -> None:
        """The plain run, as it was on the ranks that trained, for a newcomer to compare against."""
        objects = [self.reference.state_dict(), self.plain.state_dict(), self.steps]
        dist.broadcast_object_list(objects, src=0)
        self.reference.load_state_dict(objects[0])
        self.plain.load_state_dict(objects[1])
        self.steps = objects[2]

    def outcome(self) -> dict:
        return {"error": self.error, "checks": self.checks, "steps": self.steps,
                "bytes": self.sharded.state_bytes_per_rank()}


def _grow_die_resume(process, port, stage, folder, results):
    """2 ranks; a newcomer makes 3; checkpoint; rank 1 dies, 2 go on; a fresh pair resumes the checkpoint."""
    store = client(port)
    run = _Run(stage)
    # All 3 cut the initial weights; rank 2 dies before the first step: its shard of the initial
    # weights comes from rank 0's buddy copy. It comes back later as a newcomer holding nothing.
    join(store, 0, process, 3)
    run.sharded.form(None, steps=0)
    results[("freed", process)] = all(t.numel() == 0 for t in run.given.parameters())
    previous = None
    if process < 2:
        previous = run.sharded.position
        join(store, 10, process, 2)
        run.sharded.form(previous, steps=0)
        run.check()
        for _ in range(STEPS):
            run.step()
        previous = run.sharded.position
    join(store, 1, process, 3)
    run.sync_reference_from_rank_0()
    run.sharded.form(previous, steps=run.steps)
    run.check()
    for _ in range(STEPS):
        run.step()
    results[("at 3", process)] = run.outcome()
    results[("saved", process)] = [p.full_tensor().detach() for p in run.sharded._params]
    torch.save(run.sharded.sharded_state_dict(), f"{folder}/shard{process}.pt")
    dist.barrier()
    if process == 1:
        return  # dies without a word
    previous = run.sharded.position
    join(store, 2, [0, 2].index(process), 2)
    # A restart here would read pieces for the place at 2 (with a buddy: every piece), not at 3.
    results[("survivor wants", process)] = [run.sharded.wants_piece(r, 3) for r in range(3)]
    run.sharded.form(previous, steps=run.steps)
    for _ in range(STEPS):
        run.step()
    results[("after death", process)] = run.outcome()
    pieces = [torch.load(f"{folder}/shard{rank}.pt", weights_only=True) for rank in range(3)]
    join(store, 3, [0, 2].index(process), 2)
    # Before `form` a survivor that last held 3-rank shards asks for the pieces of its place at 2.
    lean = FullyShardedModel(_mlp(), stage=stage, replicas=0)
    results[("wants", process)] = [lean.wants_piece(r, 3) for r in range(3)]
    restored = _Run(stage)
    restored.sharded.check_pieces(pieces)
    restored.sharded.form(None, steps=0, pieces=pieces)
    for at_step in (0, run.steps):
        try:  # the survivors' shards forgotten, their initial weights freed, no checkpoint
            run.sharded.form(None, steps=at_step)
            results[("from nothing", at_step, process)] = None
        except ElasticError as exc:
            results[("from nothing", at_step, process)] = f"{type(exc).__name__}: {exc}"
    results[("resumed", process)] = {"steps": restored.sharded.position.steps,
                                     "params": [p.full_tensor().detach() for p in restored.sharded._params]}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_equal_plain_adamw_through_a_grow_a_death_and_a_resume_at_another_size(stage, tmp_path):
    results = spawn(_grow_die_resume, stage, str(tmp_path))
    for process in range(3):
        outcome = results[("at 3", process)]
        assert outcome["steps"] == 2 * STEPS and outcome["error"] <= TOLERANCE, outcome
    for process in (0, 2):
        outcome = results[("after death", process)]
        assert outcome["steps"] == 3 * STEPS and outcome["error"] <= TOLERANCE, outcome
        assert outcome["bytes"]["buddy"] > 0
    # Each rank holds a third of the parameters and 2 AdamW states, and one buddy copy of both.
    held = [results[("at 3", p)]["bytes"] for p in range(3)]
    numel = sum(p.numel() for p in _mlp().parameters())
    assert sum(b["params"] for b in held) == numel * 8
    assert sum(b["optimizer"] for b in held) == numel * 8 * 2
    assert sum(b["buddy"] for b in held) == numel * 8 * 3
    # The checkpoint of 3 ranks resumes at 2 with the parameters it saved.
    for process in (0, 2):
        resumed = results[("resumed", process)]
        assert resumed["steps"] == 2 * STEPS
        for saved, loaded in zip(results[("saved", 0)], resumed["params"]):
            assert torch.equal(saved, loaded)
    for process in (0, 2):
        assert "No rank holds the model's shards or its initial weights" in results[("from nothing", 0, process)]
        assert results[("from nothing", 3 * STEPS, process)].startswith("ShardLostError: No rank holds ZeRO")
    assert all(results[("freed", p)] for p in range(3)), "the given model's weights outlived the first formation"
    # Without buddies rank 0 of 2 needs only the pieces of 3 that overlap its rows, rank 1 likewise.
    assert results[("wants", 0)] == [True, True, False] and results[("wants", 2)] == [False, True, True]
    assert results[("survivor wants", 0)] == results[("survivor wants", 2)] == [True, True, True]


def test_a_model_or_checkpoint_it_cannot_shard_is_refused_with_the_fix():
    with pytest.raises(ElasticError, match="mix dtypes"):
        FullyShardedModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), stage=3)
    with pytest.raises(ElasticError, match="must step every parameter of the prepared model"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        FullyShardedModel(model, stage=3).adopt(torch.optim.AdamW(model[1].parameters()))
    frozen = nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    with pytest.raises(ElasticError, match="do not require grad"):
        FullyShardedModel(frozen, stage=2)
    scalar = nn.Linear(2, 2)
    scalar.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ElasticError, match=r"Parameters \['scale'\] are 0-dimensional"):
        FullyShardedModel(scalar, stage=3)
    zero_1_piece = {"numel": 6, "steps": 1, "spans": [[0, 6]], "tensors": {}, "scalars": {}}
    with pytest.raises(ElasticError, match="does not fit this model under ZeRO-2/3"):
        FullyShardedModel(nn.Linear(2, 2), stage=3).check_pieces([zero_1_piece])
    with pytest.raises(ElasticError, match="written under ZeRO-2/3"):
        ShardedOptimizer(torch.optim.AdamW(nn.Linear(2, 2).parameters())).load_sharded(
            [{**zero_1_piece, "segments": [[2, 2], [2, 1]]}])
