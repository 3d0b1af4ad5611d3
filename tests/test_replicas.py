"""Replicas as the elastic unit (`elastic.parallel.replicas`), with pipelined replicas (`elastic.parallel.pipeline`),
in real gloo processes without Ray.

dp=2 x pp=2 on 4 processes: each replica pipelines its share of the global batch, each stage's
gradients are averaged over its data-parallel group, and the parameters after every step must
equal one plain model stepped by AdamW on the whole global batch within 1e-12 (float64, Tanh).
Then a stage worker of replica 1 dies: its replica leaves, replica 0 goes on alone with the
whole global batch; then capacity returns and a new replica forms, each of its stages taking its
state (parameters and AdamW moments) from the same stage of replica 0 over the data-parallel
group. The script stands in for the controller, which is not wired to replicas yet.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.comm.state_sync import sync_state
from elastic.errors import ElasticError
from elastic.parallel.pipeline import PipelinedModel
from elastic.parallel.replicas import Position, ReplicaShape
from gloo_processes import client, join, spawn

pytestmark = pytest.mark.timeout(180)
TOLERANCE = 1e-12
GLOBAL_BATCH = 16
STEPS = 3
SHAPE = ReplicaShape(pipeline_stages=2)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class _Stage:
    """This process's stage of a pipelined replica, and a plain model on the whole batch beside it."""

    def __init__(self, seed: int) -> None:
        self.pipe = PipelinedModel(_mlp(seed), stages=SHAPE.pipeline_stages, loss_fn=nn.functional.mse_loss,
                                   microbatches=2, schedule="1f1b")
        self.optimizer = None
        self.plain = _mlp()
        self.plain_optimizer = _optimizer(self.plain.parameters())
        self.steps, self.error = 0, 0.0

    def form(self, world_size: int, holds_state: bool) -> None:
        """Bind the generation's groups; a new replica's stage takes the live replica's state."""
        mesh = SHAPE.mesh(world_size)
        self.dp, self.replicas = mesh.get_group("dp"), SHAPE.replicas(world_size)
        self.pipe.bind(mesh.get_group("pp"))
        if self.optimizer is None:
            self.optimizer = _optimizer(self.pipe.module.parameters())
        objects = {"stage": self.pipe.module, "optimizer": self.optimizer}
        sync_state(objects, {"step": self.steps}, torch.device("cpu"), holds_state, group=self.dp)
        reference = [self.plain.state_dict(), self.plain_optimizer.state_dict(), self.steps]
        dist.broadcast_object_list(reference, src=0)
        self.plain.load_state_dict(reference[0])
        self.plain_optimizer.load_state_dict(reference[1])
        self.steps = reference[2]
        self.check()

    def step(self) -> None:
        generator = torch.Generator().manual_seed(self.steps)
        x = torch.randn(GLOBAL_BATCH, 8, generator=generator, dtype=torch.float64)
        y = torch.randn(GLOBAL_BATCH, 1, generator=generator, dtype=torch.float64)
        replica = SHAPE.position(dist.get_rank()).replica
        share = slice(replica * GLOBAL_BATCH // self.replicas, (replica + 1) * GLOBAL_BATCH // self.replicas)
        self.pipe.step(x[share], y[share])
        for param in self.pipe.module.parameters():  # equal shares: the replicas' mean is the batch's gradient
            dist.all_reduce(param.grad, group=self.dp)
            param.grad /= self.replicas
        self.optimizer.step()
        self.plain_optimizer.zero_grad()
        nn.functional.mse_loss(self.plain(x), y).backward()
        self.plain_optimizer.step()
        self.steps += 1
        self.check()

    def check(self) -> None:
        plain = dict(self.plain.named_parameters())
        for name, param in self.pipe.module.named_parameters():
            self.error = max(self.error, (param - plain[name]).abs().max().item())


def _replica_leaves_and_another_joins(process, port, results):
    store = client(port)
    stage = _Stage(seed=0)
    join(store, 0, process, 4)
    stage.form(4, holds_state=False)
    for _ in range(STEPS):
        stage.step()
    # Process 3 (replica 1, stage 1) dies: the rule keeps whole replicas only.
    staying, released = SHAPE.whole_replicas([True, True, True, False])
    results[("rule", process)] = (staying, released)
    if process in staying:
        join(store, 1, staying.index(process), len(staying))
        stage.form(len(staying), holds_state=True)
        for _ in range(STEPS):
            stage.step()
    else:
        stage = _Stage(seed=process + 1)  # a replacement: other weights, no optimizer state, until synced
    join(store, 2, process, 4)
    stage.form(4, holds_state=process in staying)
    for _ in range(STEPS):
        stage.step()
    results[process] = {"error": stage.error, "steps": stage.steps,
                        "position": SHAPE.position(process), "held": sorted(n for n, _ in stage.pipe.module.named_parameters())}


def test_a_replica_leaves_whole_the_other_carries_the_global_batch_and_a_new_one_takes_stage_state():
    results = spawn(_replica_leaves_and_another_joins, nprocs=4)
    assert results[("rule", 0)] == ([0, 1], [2])
    for process in range(4):
        outcome = results[process]
        assert outcome["steps"] == 3 * STEPS, outcome
        assert outcome["error"] <= TOLERANCE, outcome
    assert results[0]["held"] == results[2]["held"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert results[1]["held"] == results[3]["held"] == ["4.bias", "4.weight"]


def test_positions_and_the_whole_replica_rule():
    shape = ReplicaShape(pipeline_stages=2, tensor_parallel=2)
    assert shape.size == 4 and shape.replicas(12) == 3
    assert shape.position(7) == Position(replica=1, stage=1, tensor=1)
    assert shape.position(8) == Position(replica=2, stage=0, tensor=0)
    alive = [True] * 12
    alive[5] = False  # replica 1 loses stage 0's second tensor-parallel worker
    assert shape.whole_replicas(alive) == ([0, 1, 2, 3, 8, 9, 10, 11], [4, 6, 7])
    with pytest.raises(ElasticError, match=r"world_size\(6\) is not a whole number of replicas of 4 workers"):
        shape.replicas(6)
    with pytest.raises(ElasticError, match=r"each must be 1 or more"):
        ReplicaShape(pipeline_stages=0)
