"""Stale synchrony (`Strategy(sync="stale:bound=S")`) through grows, deaths, an outside SIGKILL
inside a slow step, and a restart from its checkpoint: each run ends within 1e-9 (float64) of
one process applying each step's whole-batch gradient S steps late (`plain_reference(stale=S)`),
with every sample counted once. The runs are `test_techniques`' (`_fit`, `_fit_held`)."""

from types import SimpleNamespace

import pytest

from elastic import CheckpointConfig, FailureConfig, Fault, ScalingConfig, Strategy
from test_techniques import (MAX_STEPS, SLOW_STEP_S, STARTS_AT_2, _assert_exactly_once, _fit, _fit_held,
                             _grow_to_3_once_formed, _max_diff)
from workloads import OutsideKiller, regression_reference

pytestmark = pytest.mark.timeout(240)


def _stale_reference(bound, **config):
    """What a fault-free run of `Strategy(sync=f"stale:bound={bound}")` computes, at any fixed size."""
    return regression_reference(MAX_STEPS, seed=0, stale=bound, **config)["params"]


def test_stale_synchrony_with_bound_0_is_ddp_and_bound_2_drains_before_a_planned_grow(local_ray, tmp_path):
    # bound=2: the grow's switch waits for the two reductions in flight, so nothing is rolled back.
    result = _fit_held(tmp_path, "stale-grow", 4, _grow_to_3_once_formed(), scaling=STARTS_AT_2,
                       strategy=Strategy(sync="stale:bound=2"))
    assert [(e["kind"], e["world_size"]) for e in result.events_of("generation_formed")] == [("start", 2), ("grow", 3)]
    assert _max_diff(result.value["params"], _stale_reference(2)) < 1e-9
    ddp = regression_reference(MAX_STEPS, seed=0)["params"]
    assert _max_diff(result.value["params"], ddp) > 1e-6, "stale synchrony computed DDP's run"
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)
    result = _fit(tmp_path, "stale-0", ScalingConfig(min_workers=2, max_workers=2), Strategy(sync="stale:bound=0"))
    assert _max_diff(result.value["params"], ddp) < 1e-9


def test_stale_synchrony_rolls_a_death_back_to_its_complete_state_and_replays_exactly(local_ray, tmp_path):
    # AdamW's state is replicated, and rolled back with the model: even the heal is exact.
    result = _fit(tmp_path, "stale-kill", ScalingConfig(min_workers=1, max_workers=2), Strategy(sync="stale:bound=3"),
                  faults=[Fault(kind="kill", rank=1, step=9)], optimizer="adamw")
    [recovery] = result.events_of("recovery")
    assert 3 <= recovery["steps_lost"] <= 4, f"not rolled back the 3 steps in flight: {recovery}"
    assert _max_diff(result.value["params"], _stale_reference(3, optimizer="adamw")) < 1e-9
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)


# Under `-m soak` (the suite's time on 2 cores): CI rolls a stale run back through the Fault kill
# above, and has a slow-step outside SIGKILL through the chaos matrix (a newcomer's, inside a 0.25 s step).
@pytest.mark.soak
def test_stale_synchrony_heals_a_sigkill_from_outside_inside_a_slow_step_and_ends_exact(local_ray, tmp_path):
    killer = OutsideKiller("mid-step", str(tmp_path), "stale-sigkill", SimpleNamespace(compute_s=SLOW_STEP_S), seed=3)
    killer.start()
    result = _fit(tmp_path, "stale-sigkill", ScalingConfig(min_workers=2, max_workers=3),
                  Strategy(sync="stale:bound=2"), compute_s=SLOW_STEP_S)
    assert killer.done.wait(60) and killer.killed, "the outside kill never happened"
    assert result.events_of("recovery"), "no heal"
    assert _max_diff(result.value["params"], _stale_reference(2)) < 1e-9
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)


def test_a_stale_checkpoint_holds_the_complete_state_and_a_restart_from_it_is_exact(local_ray, tmp_path):
    # Both workers die at step 14: the run restarts from its checkpoint of live step 8, which holds
    # the complete state of step 6 (S = 2 behind) with the two gradients still to apply.
    result = _fit(tmp_path, "stale-ckpt", ScalingConfig(min_workers=1, max_workers=2), Strategy(sync="stale:bound=2"),
                  faults=[Fault(kind="kill", rank=0, step=14), Fault(kind="kill", rank=1, step=14)],
                  checkpoint=CheckpointConfig(every_steps=8), failure=FailureConfig(max_failures=1),
                  hold_for_checkpoint=(13, 6, str(tmp_path / "stale-ckpt")))
    assert [e["step"] for e in result.events_of("generation_formed") if e["kind"] == "restart"] == [6]
    assert _max_diff(result.value["params"], _stale_reference(2)) < 1e-9
    _assert_exactly_once(result.value["ledger"], MAX_STEPS)
