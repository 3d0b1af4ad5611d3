"""The run's state registry (`elastic.comm.state_sync.RunState`): named, typed holders whose names are the
checkpoint's format, the train loop's own after elastic's, and an optimizer prepared late taking what
its stand-in kept. No group, no Ray."""

import pytest
import torch

from elastic.comm.state_sync import ENTRIES, AwaitedState, RunState, load_into
from elastic.errors import ElasticError

pytestmark = pytest.mark.timeout(60)

# The names checkpoints were written with since format 1: renaming one stops older checkpoints loading.
ON_DISK = ("rng", "model", "powersgd", "stale", "outer_sync", "optimizer", "grad_scaler", "data_stream")


def test_every_entry_keeps_the_name_checkpoints_hold_it_under_and_says_its_kind():
    assert tuple(entry.name for entry in ENTRIES) == ON_DISK
    state = RunState(torch.zeros(1))
    assert all(hasattr(state, entry.name) for entry in ENTRIES)
    assert {entry.kind for entry in ENTRIES} <= {"replicated", "per-rank", "sharded"}


def test_only_the_holders_set_are_synced_elastics_first_then_the_loops_own():
    state = RunState(torch.zeros(1))
    state.register("ledger", torch.ones(2))
    state.model = torch.nn.Linear(2, 1)
    assert [name for name, _ in state.items()] == ["rng", "model", "ledger"]
    states = state.states()
    assert list(states) == ["rng", "model", "ledger"] and set(states["model"]) == {"weight", "bias"}
    assert state.holder("ledger") is dict(state.items())["ledger"] and state.holder("model") is state.model


@pytest.mark.parametrize("name", [*ON_DISK, "ledger"])
def test_the_train_loop_cannot_register_a_name_already_taken(name):
    state = RunState(torch.zeros(1))
    state.register("ledger", torch.zeros(1))
    with pytest.raises(ElasticError, match=rf"state '{name}' is already registered; pick another name"):
        state.register(name, torch.zeros(1))


def test_an_optimizer_prepared_at_its_first_step_takes_the_momentum_its_stand_in_received():
    weight = torch.nn.Parameter(torch.ones(2))
    peer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    weight.grad = torch.ones(2)
    peer.step()
    state = RunState(torch.zeros(1))
    state.optimizer = AwaitedState()
    load_into(state.optimizer, peer.state_dict())  # what a sync or a restored checkpoint brings
    mine = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    state.adopt_optimizer(mine)
    assert state.optimizer is mine
    momentum = [optimizer.state_dict()["state"][0]["momentum_buffer"] for optimizer in (mine, peer)]
    assert torch.equal(*momentum)


def test_an_optimizer_whose_stand_in_received_nothing_keeps_its_own_state():
    state = RunState(torch.zeros(1))
    state.optimizer = AwaitedState()
    mine = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    state.adopt_optimizer(mine)
    assert state.optimizer is mine and mine.state_dict()["state"] == {}
