"""ZeRO-1 with live resharding (`elastic.techniques.zero`) against the plain optimizer, in real processes on
gloo, no Ray.

Every process steps a model with `ShardedOptimizer` and, beside it, a copy with the plain
optimizer on the very same gradients. After every step the parameters and this rank's shard of
the state must equal the plain optimizer's within 1e-12 (float64). Each process computes the
whole batch's gradient itself, so every `.grad` holds what DDP's all-reduce would leave there.
The plan's arithmetic and the constructor's checks are tested without processes.
"""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.errors import ElasticError
from elastic.techniques.shard_plan import Layout, ShardLostError, ShardPosition, plan_reshard
from elastic.techniques.zero import ShardedOptimizer
from gloo_processes import client, join, spawn

pytestmark = pytest.mark.timeout(120)
TOLERANCE = 1e-12
STEPS = 3
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}
STATE_NAMES = {"adamw": ["exp_avg", "exp_avg_sq"], "sgd": ["momentum_buffer"]}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()  # 161 elements


class _Pair:
    """A model stepped by ShardedOptimizer and a copy stepped by the plain optimizer, same gradients."""

    def __init__(self, kind: str = "adamw", replicas: int = 1) -> None:
        self.kind, self.replicas = kind, replicas
        self.model = _mlp()
        self.reference = copy.deepcopy(self.model)
        self.sharded = ShardedOptimizer(OPTIMIZERS[kind](self.model.parameters()), replicas=replicas)
        self.plain = OPTIMIZERS[kind](self.reference.parameters())
        self.steps, self.checks, self.error, self.names = 0, 0, 0.0, []

    def fresh_optimizer(self) -> ShardedOptimizer:
        """A new ShardedOptimizer over the same model, as a resumed run builds it."""
        optimizer = OPTIMIZERS[self.kind](self.model.parameters())
        self.sharded = ShardedOptimizer(optimizer, replicas=self.replicas)
        return self.sharded

    def step(self) -> None:
        generator = torch.Generator().manual_seed(self.steps)
        x = torch.randn(32, 8, generator=generator, dtype=torch.float64)
        y = torch.randn(32, 1, generator=generator, dtype=torch.float64)
        self.sharded.zero_grad()
        nn.functional.mse_loss(self.model(x), y).backward()
        for param, twin in zip(self.model.parameters(), self.reference.parameters()):
            twin.grad = param.grad.clone()
        self.sharded.step()
        self.plain.step()
        self.steps += 1
        self.check()

    def check(self) -> None:
        """Fold into `error` how far the parameters and this rank's state are from the plain run's."""
        for param, twin in zip(self.model.parameters(), self.reference.parameters()):
            self.error = max(self.error, (param - twin).abs().max().item())
        piece = self.sharded.sharded_state_dict()
        states = [self.plain.state[p] for p in self.reference.parameters()]
        self.names = sorted(piece["tensors"])
        for name, shard in piece["tensors"].items():
            whole = torch.cat([state[name].reshape(-1) for state in states])[slice(*piece["spans"][0])]
            if shard.numel():
                self.error = max(self.error, (shard - whole).abs().max().item())
        for name, value in piece["scalars"].items():
            if float(value) != float(states[0][name]):
                self.error = float("inf")
        self.checks += 1

    def sync_from_rank_0(self) -> None:
        """The model (replicated, as the run's state sync leaves it) and the plain reference run."""
        objects = [self.model.state_dict(), self.reference.state_dict(), self.plain.state_dict(), self.steps]
        dist.broadcast_object_list(objects, src=0)
        self.model.load_state_dict(objects[0])
        self.reference.load_state_dict(objects[1])
        self.plain.load_state_dict(objects[2])
        self.steps = objects[3]

    def outcome(self) -> dict:
        return {"error": self.error, "checks": self.checks, "steps": self.steps, "names": self.names}


def _assert_equal_to_plain(outcome: dict, steps: int, kind: str = "adamw") -> None:
    assert outcome["steps"] == steps and outcome["checks"] >= 1, outcome
    assert outcome["names"] == STATE_NAMES[kind], outcome
    assert outcome["error"] <= TOLERANCE, outcome


def _at_each_world_size(process, port, results):
    store = client(port)
    generation = 0
    for world_size in (1, 2, 3):
        for kind in OPTIMIZERS:
            generation += 1
            if process >= world_size:
                continue
            join(store, generation, process, world_size)
            pair = _Pair(kind)
            hook_calls = []
            pair.sharded.register_step_post_hook(lambda *_: hook_calls.append(1))
            pair.sharded.reshard(None)
            for _ in range(STEPS):
                pair.step()
            results[(world_size, kind, process)] = {**pair.outcome(), "hooks": len(hook_calls),
                                                    "bytes": pair.sharded.state_bytes_per_rank()}


def test_sharded_steps_equal_the_plain_optimizer_at_world_sizes_1_2_3():
    results = spawn(_at_each_world_size)
    for world_size in (1, 2, 3):
        for kind in OPTIMIZERS:
            outcomes = [results[(world_size, kind, process)] for process in range(world_size)]
            for outcome in outcomes:
                _assert_equal_to_plain(outcome, STEPS, kind)
                assert outcome["hooks"] == STEPS, "step post hooks did not fire on every step"
            own = [outcome["bytes"].own for outcome in outcomes]
            assert sum(own) == 161 * 8 * len(STATE_NAMES[kind]), "the shards do not hold the state once"
            expected_buddy = [own[(r - 1) % world_size] if world_size > 1 else 0 for r in range(world_size)]
            assert [outcome["bytes"].buddy for outcome in outcomes] == expected_buddy


def _grow_then_planned_shrink(process, port, results):
    """2 ranks, a newcomer makes 3, then rank 2 sends its shard and leaves; replicas=0, so
    nothing comes from a buddy copy."""
    store = client(port)
    pair = _Pair(replicas=0)
    previous = None  # the newcomer holds nothing
    if process < 2:
        join(store, 0, process, 2)
        pair.sharded.reshard(None)
        for _ in range(STEPS):
            pair.step()
        previous = pair.sharded.position
    join(store, 1, process, 3)
    pair.sync_from_rank_0()
    pair.sharded.reshard(previous)
    for _ in range(STEPS):
        pair.step()
    pair.sharded.reshard(pair.sharded.position, leaving=process == 2)
    if process == 2:
        results[process] = {**pair.outcome(), "holds": pair.sharded.position}
        return
    join(store, 2, process, 2)
    pair.sharded.bind()
    for _ in range(STEPS):
        pair.step()
    results[process] = pair.outcome()


def test_a_grow_2_to_3_and_a_planned_shrink_3_to_2_keep_the_plain_trajectory():
    results = spawn(_grow_then_planned_shrink)
    for process in (0, 1):
        _assert_equal_to_plain(results[process], 3 * STEPS)
    _assert_equal_to_plain(results[2], 2 * STEPS)
    assert results[2]["holds"] is None, "the leaving rank still holds state after the reshard"


def _deaths(process, port, results):
    """3 ranks; rank 1 dies, the survivors go on at 2; then old rank 2 dies and rank 0 goes on alone."""
    store = client(port)
    pair = _Pair(replicas=1)
    join(store, 0, process, 3)
    pair.sharded.reshard(None)
    for _ in range(STEPS):
        pair.step()
    if process == 1:
        return  # dies without a word
    previous = pair.sharded.position
    join(store, 1, [0, 2].index(process), 2)
    pair.sharded.reshard(previous)
    for _ in range(STEPS):
        pair.step()
    results[(2, process)] = pair.outcome()
    if process == 2:
        return
    previous = pair.sharded.position
    join(store, 2, 0, 1)
    pair.sharded.reshard(previous)
    for _ in range(STEPS):
        pair.step()
    results[(1, process)] = pair.outcome()


def test_survivors_continue_from_buddy_copies_when_ranks_die_one_after_another():
    results = spawn(_deaths)
    _assert_equal_to_plain(results[(2, 0)], 2 * STEPS)
    _assert_equal_to_plain(results[(2, 2)], 2 * STEPS)
    _assert_equal_to_plain(results[(1, 0)], 3 * STEPS)


def _death_without_replicas(process, port, results):
    store = client(port)
    pair = _Pair(replicas=0)
    join(store, 0, process, 3)
    pair.sharded.reshard(None)
    for _ in range(STEPS):
        pair.step()
    if process == 1:
        return
    previous = pair.sharded.position
    join(store, 1, [0, 2].index(process), 2)
    try:
        pair.sharded.reshard(previous)
        results[process] = None
    except ShardLostError as exc:
        results[process] = {"lost": exc.lost_ranks, "message": str(exc)}


def test_a_death_without_replicas_raises_shard_lost_on_every_survivor():
    results = spawn(_death_without_replicas)
    for process in (0, 2):
        assert results[process] is not None, "the survivors resharded although rank 1's state is gone"
        assert results[process]["lost"] == [1]
        assert "old rank(s) [1] of 3" in results[process]["message"]
        assert "restart from a checkpoint" in results[process]["message"]


def _checkpoint_then_resume(process, port, folder, results):
    """Save at 3 ranks; load at 1 (rank 0 alone), then at 2, step, lose rank 1, go on at 1."""
    store = client(port)
    pair = _Pair(replicas=1)
    join(store, 0, process, 3)
    pair.sharded.reshard(None)
    for _ in range(STEPS):
        pair.step()
    torch.save(pair.sharded.sharded_state_dict(), f"{folder}/shard{process}.pt")
    dist.barrier()
    if process == 2:
        return
    pieces = [torch.load(f"{folder}/shard{rank}.pt", weights_only=True) for rank in range(3)]
    if process == 0:
        join(store, 1, 0, 1)
        pair.fresh_optimizer().reshard(None)
        pair.sharded.load_sharded(pieces)
        pair.check()
        results[(1, 0)] = pair.outcome()
    join(store, 2, process, 2)
    lean = ShardedOptimizer(OPTIMIZERS["adamw"](copy.deepcopy(pair.model).parameters()), replicas=0)
    lean.reshard(None)
    results[("wants", process)] = [lean.wants_piece(rank, 3) for rank in range(3)]
    pair.fresh_optimizer().reshard(None)
    pair.sharded.load_sharded(pieces)
    pair.check()
    for _ in range(STEPS):
        pair.step()
    results[(2, process)] = pair.outcome()
    if process == 1:
        return  # dies: its shard comes from the buddy copy that load_sharded built on rank 0
    previous = pair.sharded.position
    join(store, 3, 0, 1)
    pair.sharded.reshard(previous)
    pair.step()
    results[("after death", 0)] = pair.outcome()


def test_a_checkpoint_saved_by_3_ranks_loads_at_1_and_at_2_with_its_buddy_copies(tmp_path):
    results = spawn(_checkpoint_then_resume, str(tmp_path))
    _assert_equal_to_plain(results[(1, 0)], STEPS)
    _assert_equal_to_plain(results[(2, 0)], 2 * STEPS)
    _assert_equal_to_plain(results[(2, 1)], 2 * STEPS)
    _assert_equal_to_plain(results[("after death", 0)], 2 * STEPS + 1)
    # Without buddies a rank of 2 needs only the pieces of the 3 that overlap its half.
    assert results[("wants", 0)] == [True, True, False] and results[("wants", 1)] == [False, True, True]


def _sent(transfers) -> int:
    return sum(t.stop - t.start for t in transfers if t.source != t.target)


def test_growing_2_to_3_sends_only_to_the_newcomer_what_it_needs():
    positions = [ShardPosition(0, 2, 5), ShardPosition(1, 2, 5), None]
    transfers = plan_reshard(Layout.flat(12), positions, [False] * 3, replicas=1)
    assert {t.target for t in transfers if t.source != t.target} == {2}
    assert _sent(transfers) == 8  # its own range [8, 12) and its buddy copy [4, 8)


def test_a_death_is_served_by_the_dead_ranks_buddy():
    positions = [ShardPosition(0, 3, 5), ShardPosition(2, 3, 5)]  # old rank 1 died
    transfers = plan_reshard(Layout.flat(12), positions, [False, False], replicas=1)
    moved = {(t.start, t.stop) for t in transfers if t.owner == 1 and t.source != t.target}
    assert moved == {(4, 6), (6, 8)}
    assert all(t.source == 1 for t in transfers if t.owner == 1)  # old rank 2 keeps old rank 1's copy
    assert _sent(transfers) == 8


def test_two_neighbours_dying_with_one_replica_lose_a_shard_and_the_error_pickles():
    with pytest.raises(ShardLostError) as caught:
        positions = [ShardPosition(0, 4, 5), None, None, ShardPosition(3, 4, 5)]  # old 1 and 2 died
        plan_reshard(Layout.flat(12), positions, [False] * 4, replicas=1)
    assert caught.value.lost_ranks == [1]  # old rank 2's copy lives on rank 3
    assert pickle.loads(pickle.dumps(caught.value)).lost_ranks == [1]


def test_positions_from_different_groups_are_refused():
    with pytest.raises(ElasticError, match="different groups"):
        plan_reshard(Layout.flat(12), [ShardPosition(0, 2, 5), ShardPosition(1, 2, 4)], [False, False], replicas=1)


@pytest.mark.parametrize("build, message", [
    (lambda m: torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[2].parameters()}]), "2 param groups"),
    (lambda m: torch.optim.SGD([m[0].weight, m[2].weight.detach().float().requires_grad_()]), "mix dtypes"),
    (lambda m: torch.optim.SGD([m[0].weight, m[2].weight.detach()]), "do not require grad"),
])
def test_an_optimizer_it_cannot_shard_is_refused_with_the_fix(build, message):
    with pytest.raises(ElasticError, match=message):
        ShardedOptimizer(build(_mlp()))


def test_an_optimizer_that_has_stepped_is_refused():
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.float64)).sum().backward()
    optimizer.step()
    with pytest.raises(ElasticError, match="has stepped already"):
        ShardedOptimizer(optimizer)


def test_a_death_inside_a_step_uses_only_the_copies_of_the_step_the_group_resumes_at():
    # Old rank 1 of 3 died during the all-gather: ranks 0 and 2 stepped their own shards to
    # step 6 but hold buddy copies of step 5.
    torn = [ShardPosition(0, 3, 6, 5), ShardPosition(2, 3, 6, 5)]
    with pytest.raises(ShardLostError) as at_5:
        plan_reshard(Layout.flat(12), torn, [False, False], replicas=1, steps=5)  # nobody wrote step 6's parameters
    assert at_5.value.lost_ranks == [0], "old rank 0's step-5 state was only in the dead rank's buddy copy"
    with pytest.raises(ShardLostError) as at_6:
        plan_reshard(Layout.flat(12), torn, [False, False], replicas=1, steps=6)  # someone did: own shards count
    assert at_6.value.lost_ranks == [1], "old rank 1's step-6 state was never copied"
    transfers = plan_reshard(Layout.flat(12), torn, [False, False], replicas=2, steps=5)  # two buddies each
    assert {t.owner for t in transfers} == {0, 1, 2} and all(t.source in (0, 1) for t in transfers)
