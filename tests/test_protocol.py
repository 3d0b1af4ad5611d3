"""Every transition of the controller's protocol, with a fake worker group and no Ray.

`FakeWorkerGroup` (`elastic/controller/fake_group.py`) carries out the protocol's actions in
memory and feeds back what real workers would report, through hooks such as `die(w)` and
`form(g)`. Each test advances the protocol one observation at a time and reads as the rule it
checks.
"""

import dataclasses

import pytest

from elastic.config import FailureConfig, ScalingConfig
from elastic.controller.fake_group import MAX_STEPS, FakeWorkerGroup, death
from elastic.controller.policies import CONNECT_CEILING_S
from elastic.controller.protocol import MAX_FAILED_FORMATIONS, Protocol, Status
from elastic.controller.signals import (
    PREPARE_SLACK_STEPS, Abort, FormedReport, GroupBroken, Offer, Prepare, ProbesRead, ShardWritten, Straggling, Tick,
    ProbeReading, WorkerReady, coalesce,
)
from elastic.controller.states import Reason


def progress(step=10, arrived=-1, checkpointing=False, entered_sync=None, connected=None):
    entered = step if entered_sync is None else entered_sync
    return ProbeReading(step=step, entered_sync=entered, launched=entered, arrived=arrived, checkpointing=checkpointing,
                          connected=arrived if connected is None else connected)


# --- starting ---------------------------------------------------------------------------------
def test_start_requests_max_workers_plus_spares():
    group = FakeWorkerGroup(max_workers=3, spare_workers=1)
    assert group.started == [0, 1, 2, 3]
    assert group.state == "WAITING"


def test_the_first_generation_waits_briefly_for_workers_starting_alongside():
    group = FakeWorkerGroup(min_workers=2, max_workers=3)
    group.ready(0, 1)
    assert not group.offers, "formed before the third worker had its grace period"
    group.send(Tick(), after_s=group.protocol.scaling.start_grace_s + 0.1)
    assert group.latest_offer.formation.members == (0, 1)


def test_a_start_grace_longer_than_the_capacity_timeout_starts_with_the_ready_workers_instead_of_failing():
    group = FakeWorkerGroup(min_workers=2, max_workers=3, capacity_timeout_s=1)
    group.ready(0, 1)
    group.send(Tick(), after_s=2)
    assert group.state == "WAITING" and not group.offers, "the grace was cut short or the run failed"
    group.send(Tick(), after_s=group.protocol.scaling.start_grace_s)
    assert group.latest_offer.formation.members == (0, 1)


def test_the_first_generation_restores_the_checkpoint_and_commits_when_every_member_formed():
    group = FakeWorkerGroup()
    group.ready(0, 1, 2)
    offer = group.latest_offer
    assert offer.restart and offer.formation.reason == Reason.START and offer.formation.members == (0, 1, 2)
    group.form(members=(0, 1))
    assert group.state == "FORMING", "committed before every member acknowledged"
    group.form(members=(2,))
    assert group.state == "RUNNING"
    [formed] = group.events("generation_formed")
    assert formed["generation"] == 0 and formed["world_size"] == 3


def test_waiting_below_min_workers_fails_after_the_capacity_timeout():
    group = FakeWorkerGroup(min_workers=2, capacity_timeout_s=20)
    group.ready(0)
    group.send(Tick(), after_s=group.protocol.scaling.start_grace_s + 0.1)
    assert group.state == "WAITING"
    group.send(Tick(), after_s=10)
    assert group.state == "FAILED" and group.protocol.state.kind == "capacity"
    assert "min_workers(2)" in group.protocol.state.error


# --- healing ------------------------------------------------------------------------------------
def test_a_death_is_healed_at_once_without_the_dead_and_a_replacement_is_requested():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.die(1)
    offer = group.latest_offer
    assert offer.formation.reason == Reason.HEAL and offer.formation.members == (0, 2)
    assert not offer.restart and offer.formation.switch_step is None
    assert group.started[-1] == 3
    group.form(step=16)
    [recovery] = group.events("recovery")
    assert recovery["world_size"] == 2 and not recovery["from_checkpoint"]
    assert group.protocol.failures == 0, "a death is not a failure"


def test_a_broken_group_heals_every_member_still_alive():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(GroupBroken(0, generation=0))
    assert group.latest_offer.formation.members == (0, 1, 2)
    group.send(GroupBroken(2, generation=0))
    assert len(group.offers) == 2, "a second report of the same break offered again"


def test_a_death_during_a_heal_aborts_it_and_offers_the_next_generation_without_the_dead():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(GroupBroken(0, generation=0))
    group.form(members=(0,))
    group.die(2)
    assert group.aborted == [1]
    assert group.latest_offer.formation.generation == 2 and group.latest_offer.formation.members == (0, 1)
    group.form(generation=1)  # stale reports of the aborted generation change nothing
    assert group.state == "FORMING"
    group.form(generation=2)
    assert group.state == "RUNNING" and group.protocol.members == (0, 1)


def test_two_deaths_within_milliseconds_end_in_one_generation_of_the_survivors():
    group = FakeWorkerGroup(min_workers=1, max_workers=4)
    group.start_run(0, 1, 2, 3)
    group.die(1)
    group.die(2)
    group.form()
    assert group.protocol.members == (0, 3) and group.state == "RUNNING"


def test_a_wave_of_deaths_in_one_batch_sends_one_heal_and_no_worker_hears_of_the_heals_it_withdrew():
    group = FakeWorkerGroup(min_workers=1, max_workers=6)
    group.start_run(*range(6))
    group.die(1)  # alone in its batch: the heal of generation 1 goes out
    sent = coalesce(group.deliver([death(2), death(3), death(4)]))
    assert [a.formation.members for a in sent if isinstance(a, Offer)] == [(0, 5)]
    aborts = [a for a in sent if isinstance(a, Abort)]
    assert [a.generation for a in aborts] == [1, 2, 3]
    assert set(aborts[0].workers) == {0, 3, 4, 5}, "generation 1 was offered: its live members must hear it is off"
    assert aborts[1].workers == aborts[2].workers == (), "generations 2 and 3 were never offered"
    assert sorted(group.offers) == [0, 1, 4]
    group.form()

    one_at_a_time = FakeWorkerGroup(min_workers=1, max_workers=6)
    one_at_a_time.start_run(*range(6))
    for worker_id in (1, 2, 3, 4):
        one_at_a_time.die(worker_id)
    one_at_a_time.form()
    assert group.state == one_at_a_time.state == "RUNNING"
    assert group.protocol.members == one_at_a_time.protocol.members == (0, 5)
    assert group.protocol.running == one_at_a_time.protocol.running == 4


def test_a_grow_prepared_in_an_earlier_batch_is_called_off_with_the_members_and_one_withdrawn_unsent_is_not():
    group = _grown_to_prepare(FakeWorkerGroup(min_workers=1, max_workers=3))  # prepare 1 went out
    [abort] = [a for a in coalesce(group.deliver([death(0)])) if isinstance(a, Abort)]
    assert abort.generation == 1 and abort.workers == (1, 2)

    group = FakeWorkerGroup(min_workers=1, max_workers=3)
    group.start_run(0, 1)
    sent = coalesce(group.deliver([WorkerReady(2, node="node-2", pid=1002), death(0)]))
    assert not [a for a in sent if isinstance(a, Prepare)]
    assert [(a.generation, a.workers) for a in sent if isinstance(a, Abort)] == [(1, ())]
    assert [a.formation.members for a in sent if isinstance(a, Offer)] == [(1, 2)]


def test_a_stale_report_of_an_older_generation_is_ignored():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.die(2)
    group.form()
    assert group.send(GroupBroken(0, generation=0)) == []


# --- growing ------------------------------------------------------------------------------------
def _grown_to_prepare(group):
    group.start_run(0, 1)
    group.ready(2)
    return group


def test_a_ready_newcomer_grows_the_run_at_the_switch_step_the_members_cannot_have_passed():
    group = _grown_to_prepare(FakeWorkerGroup(min_workers=1, max_workers=3))
    assert group.state == "PREPARING" and group.prepares[1].members == (0, 1)
    assert 1 not in group.offers, "offered before the members answered"
    group.answer_prepare({0: 40, 1: 41})
    offer = group.latest_offer
    assert offer.formation.switch_step == 41 + PREPARE_SLACK_STEPS
    assert offer.formation.members == (0, 1, 2) and offer.formation.reason == Reason.GROW
    group.form()
    assert group.state == "RUNNING" and group.events("rescale")[-1]["to_size"] == 3


def test_under_local_sgd_a_grow_switches_at_the_next_sync_boundary():
    group = FakeWorkerGroup(min_workers=1, max_workers=3)
    group.protocol.switch_every = 8
    _grown_to_prepare(group)
    group.answer_prepare({0: 40, 1: 41})
    assert group.latest_offer.formation.switch_step == 48, "not the first multiple of 8 the members can reach"


def test_a_member_death_while_preparing_a_grow_turns_it_into_a_heal_with_the_newcomer():
    group = _grown_to_prepare(FakeWorkerGroup(min_workers=1, max_workers=3))
    group.die(0)
    assert group.aborted == [1]
    offer = group.latest_offer
    assert offer.formation.reason == Reason.HEAL and offer.formation.members == (1, 2)


@pytest.mark.parametrize("newcomer_arrived", [False, True])
def test_a_member_death_during_a_grow_formation_aborts_it_and_heals(newcomer_arrived):
    group = _grown_to_prepare(FakeWorkerGroup(min_workers=1, max_workers=3))
    group.answer_prepare({0: 40, 1: 40})
    if newcomer_arrived:
        group.form(members=(2,))
    group.die(1)
    assert group.aborted == [1]
    offer = group.latest_offer
    assert offer.formation.generation == 2 and offer.formation.members == (0, 2)
    assert offer.formation.reason == Reason.HEAL and not offer.restart


def test_a_newcomer_death_right_after_it_joined_aborts_the_grow_and_heals_the_members():
    group = _grown_to_prepare(FakeWorkerGroup(min_workers=1, max_workers=3))
    group.answer_prepare({0: 40, 1: 40})
    group.form(members=(0, 1))
    group.die(2)
    assert group.aborted == [1]
    # The members may have left the old group at the switch step: they are offered a heal.
    offer = group.latest_offer
    assert offer.formation.members == (0, 1) and offer.formation.reason == Reason.HEAL


def test_a_group_break_during_a_grow_formation_does_not_abort_it():
    group = _grown_to_prepare(FakeWorkerGroup(min_workers=1, max_workers=3))
    group.answer_prepare({0: 40, 1: 40})
    assert group.send(GroupBroken(1, generation=0)) == []
    group.form()
    assert group.state == "RUNNING" and group.protocol.running == 1


def test_no_grow_is_started_when_the_switch_step_would_be_past_max_steps():
    group = FakeWorkerGroup(min_workers=1, max_workers=3, max_steps=42)
    _grown_to_prepare(group)
    group.answer_prepare({0: 40, 1: 41})
    assert group.aborted == [1] and group.state == "RUNNING"
    assert group.protocol.workers[2].status == Status.IDLE


# --- warm spares ----------------------------------------------------------------------------------
def test_a_warm_spare_replaces_a_dead_member_in_the_heal_itself():
    group = FakeWorkerGroup(min_workers=1, max_workers=2, spare_workers=1)
    group.start_run(0, 1, 2)
    assert group.protocol.members == (0, 1) and group.protocol.workers[2].status == Status.IDLE
    group.die(0)
    assert group.latest_offer.formation.members == (1, 2)
    assert group.started[-1] == 3, "a new spare is requested"
    group.form()
    assert group.events("generation_formed")[-1]["world_size"] == 2


def test_a_heal_declined_from_inside_a_between_steps_block_forms_with_the_live_members_alone_then_grows():
    # min = max = 2: one dies, the survivor waits for the replacement, and the heal takes it in. The
    # survivor is inside a between-steps block, which it runs again next and a newcomer could not:
    # it declines, and the heal forms with the survivor alone, below min_workers; the replacement
    # joins in the grow that follows.
    group = FakeWorkerGroup(min_workers=2, max_workers=2)
    group.start_run(0, 1)
    group.die(1)
    group.ready(2)
    heal = group.latest_offer
    assert heal.formation.members == (0, 2) and heal.newcomers
    group.send(FormedReport(0, heal.formation.generation, ok=False, in_block=True, error="inside a block"))
    alone = group.latest_offer
    assert alone.formation.members == (0,) and not alone.newcomers and alone.formation.reason == Reason.HEAL
    group.form()
    assert group.protocol.members == (0,) and group.state == "PREPARING", "no grow once the survivor healed"
    group.answer_prepare({0: 7})
    grow = group.latest_offer
    assert grow.formation.members == (0, 2) and grow.formation.reason == Reason.GROW and grow.newcomers
    group.form()
    assert [e["world_size"] for e in group.events("generation_formed")] == [2, 1, 2]
    assert group.protocol.failures == 0 and group.protocol.failed_formations == 0


def test_a_restart_that_takes_in_a_newcomer_beside_the_members_says_so():
    # The heal's formation loses part of the run's state: the restart takes the members, which may
    # be inside a between-steps block, and the newcomer ready meanwhile.
    group = FakeWorkerGroup(min_workers=1, max_workers=3)
    group.start_run(0, 1, 2)
    group.die(2)
    assert not group.latest_offer.newcomers
    group.ready(3)
    group.send(FormedReport(0, group.latest_offer.formation.generation, ok=False, state_lost=True,
                            error="a shard without a holder", checkpointed=True))
    restart = group.latest_offer
    assert restart.restart and restart.formation.members == (0, 1, 3) and restart.newcomers


# --- state never silently goes back to step 0 ---------------------------------------------------
def test_newcomers_alone_never_form_with_fresh_weights_they_restart_from_the_checkpoint():
    group = FakeWorkerGroup(min_workers=1, max_workers=2, max_failures=1)
    group.start_run(0, 1)
    group.die(0)
    group.die(1)
    group.ready(2, 3)
    offer = group.latest_offer
    assert offer.restart and offer.formation.reason == Reason.RESTART
    assert group.events("decision")[-1]["action"] == "RESTART"


def test_losing_every_worker_fails_the_run_past_max_failures():
    group = FakeWorkerGroup(min_workers=1, max_workers=1)
    group.start_run(0)
    group.die(0)
    assert group.state == "FAILED" and group.protocol.state.kind == "all_lost"


def test_a_newcomer_that_synced_in_an_aborted_generation_does_not_count_as_holding_state():
    group = FakeWorkerGroup(min_workers=1, max_workers=2, max_failures=1)
    group.start_run(0)
    group.ready(1)
    group.answer_prepare({0: 5})
    group.form(members=(1,))
    group.die(0)
    assert group.latest_offer.restart, "a newcomer of an uncommitted generation was trusted with the run's state"


def test_a_restarted_controller_continues_the_generation_numbers_and_failure_count():
    protocol = Protocol(ScalingConfig(min_workers=1, max_workers=1), FailureConfig(max_failures=3), MAX_STEPS,
                        generation=7, failures=2)
    protocol.start(0.0)
    actions = protocol.step(WorkerReady(0, "n", 1), 1.0)
    [offer] = [a for a in actions if isinstance(a, Offer)]
    assert offer.formation.generation == 8 and protocol.failures == 2


# --- failures ---------------------------------------------------------------------------------------
def test_an_application_error_is_counted_and_healed_within_max_failures():
    group = FakeWorkerGroup(max_failures=1)
    group.start_run(0, 1, 2)
    group.raise_error(1)
    assert group.killed == [1] and group.protocol.failures == 1
    assert group.latest_offer.formation.members == (0, 2)
    group.form()
    group.raise_error(0)
    assert group.state == "FAILED" and group.protocol.state.kind == "app_error"
    assert group.protocol.state.traceback == "tb"


def test_generations_in_a_row_that_lose_a_member_before_a_step_fail_the_run_as_a_crash_loop():
    group = FakeWorkerGroup(min_workers=1, max_workers=3, max_heals_without_step=1)
    group.start_run(0, 1, 2)
    group.die(2)
    assert group.state == "FORMING"
    group.form()
    group.die(1)
    assert group.state == "FAILED" and group.protocol.state.kind == "crash_loop"
    assert "max_heals_without_step=1" in group.protocol.state.error


def test_a_committed_step_between_heals_resets_the_crash_loop_count():
    group = FakeWorkerGroup(min_workers=1, max_workers=3, max_heals_without_step=0)
    group.start_run(0, 1, 2)
    for step, worker_id in enumerate((2, 1), start=1):
        group.commit_step(step)
        group.die(worker_id)
        group.form()
    assert group.state == "RUNNING" and group.protocol.members == (0,)


def test_a_generation_that_fails_to_form_is_offered_again_and_the_run_fails_past_the_limit():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.die(2)
    for _ in range(MAX_FAILED_FORMATIONS + 1):
        generation = group.latest_offer.formation.generation
        group.send(FormedReport(0, generation, ok=False, error="DistNetworkError: connect timeout"))
    assert group.state == "FAILED" and group.protocol.state.kind == "formation"
    assert any(d["action"] == "REFORM" for d in group.events("decision"))


def test_generations_that_keep_failing_on_workers_sharing_a_gpu_fail_the_run_naming_the_shared_gpu_not_the_network():
    group = FakeWorkerGroup()
    group.protocol.scaling = ScalingConfig(min_workers=2, max_workers=3, use_gpu=True, resources_per_worker={"GPU": 0.5})
    group.start_run(0, 1, 2)
    group.die(2)
    for _ in range(MAX_FAILED_FORMATIONS + 1):
        generation = group.latest_offer.formation.generation
        group.send(FormedReport(0, generation, ok=False, error="DistBackendError: NCCL error"))
    error = group.protocol.state.error
    assert "GPU=0.5, so Ray puts 2 workers on one GPU, and NCCL refuses two ranks" in error, error
    assert "reach each other" not in error


def test_a_formation_that_lost_part_of_the_state_restarts_from_the_checkpoint_without_counting_a_failure():
    group = FakeWorkerGroup(min_workers=1)
    group.start_run(0, 1, 2)
    group.die(2)
    healing = group.latest_offer.formation.generation
    assert not group.latest_offer.restart
    group.send(FormedReport(0, healing, ok=False, state_lost=True, checkpointed=True,
                            error="ShardLostError: old rank 2's shard is lost"))
    assert group.aborted == [healing]
    restart = group.latest_offer
    assert restart.formation.generation == healing + 1 and restart.restart and restart.formation.members == (0, 1)
    assert [d["action"] for d in group.events("decision")][-1] == "RESTART"
    assert group.protocol.failures == 0
    group.form(step=8)
    assert group.state == "RUNNING"
    # The replay from step 8 is progress: a step past the checkpoint clears the crash-loop count.
    before = group.protocol.heals_without_step
    group.die(1)
    assert group.protocol.heals_without_step == before + 1
    group.form(step=8)
    group.commit_step(9)
    assert group.protocol.heals_without_step == 0


def test_state_lost_without_a_checkpoint_to_restart_from_fails_the_run_saying_so():
    group = FakeWorkerGroup(min_workers=1)
    group.start_run(0, 1, 2)
    group.die(2)
    group.send(FormedReport(0, group.latest_offer.formation.generation, ok=False, state_lost=True,
                            error="ShardLostError: lost"))
    assert group.state == "FAILED" and group.protocol.state.kind == "state_lost"
    assert "no complete checkpoint to restart from" in group.protocol.state.error


# --- hangs ------------------------------------------------------------------------------------------
def test_a_stall_past_the_deadline_polls_the_members_and_kills_the_one_behind():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(Tick(last_step_at=group.now, deadline_s=5.0), after_s=1.0)
    assert not group.polls
    group.send(Tick(last_step_at=group.now - 6, deadline_s=5.0), after_s=6.0)
    assert group.polls[-1].members == (0, 1, 2)
    group.send(ProbesRead({0: progress(10), 1: progress(10, entered_sync=9), 2: progress(10)}))
    assert group.killed == [1]
    assert group.events("worker_failed")[-1]["kind"] == "hang"


# --- the network: unreachable members ----------------------------------------------------------
def test_a_member_that_answers_no_ping_is_unreachable_and_healed_around_before_ray_calls_it_dead():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(Tick(last_step_at=group.now, deadline_s=10.0, reach_deadline_s=0.5), after_s=0.8)
    assert group.polls[-1].members == (0, 1, 2), "a stall past the reach deadline pings every member"
    group.send(ProbesRead({0: progress(), 1: None, 2: progress()}))
    assert group.killed == [1] and group.events("worker_failed")[-1]["kind"] == "unreachable"
    offer = group.latest_offer
    assert offer.formation.reason == Reason.HEAL and offer.formation.members == (0, 2), "no wait for its death"
    assert group.protocol.fenced(1) and not group.protocol.fenced(0)
    group.die(1)  # Ray's word, a minute later: already handled
    assert len(group.events("worker_failed")) == 1


def test_a_poll_that_no_member_answered_blames_nobody_and_the_next_one_asks_again():
    # On a loaded machine every ping can miss its timeout at once; losing every member for it
    # would fail the run. A link down leaves some members answering, not none.
    group = FakeWorkerGroup()
    group.start_run(0, 1)
    group.send(Tick(last_step_at=group.now, deadline_s=10.0, reach_deadline_s=0.5), after_s=0.8)
    group.send(ProbesRead({0: None, 1: None}))
    assert not group.killed and not group.events("worker_failed") and group.state == "RUNNING"
    group.send(Tick(last_step_at=group.now - 1.6, deadline_s=10.0, reach_deadline_s=0.5), after_s=0.8)
    assert len(group.polls) == 2, "no second poll"
    group.send(ProbesRead({0: progress(), 1: None}))
    assert group.killed == [1] and group.events("worker_failed")[-1]["kind"] == "unreachable"


def test_members_waiting_on_an_unreachable_peer_are_released_not_blamed():
    # Past the hang deadline the waiters look behind (they never finished the all-reduce the cut-off
    # peer left): the one that answers no ping is the culprit, and only it.
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(Tick(last_step_at=group.now, deadline_s=2.0, reach_deadline_s=0.5), after_s=3.0)
    group.send(ProbesRead({0: progress(10, entered_sync=10), 1: None, 2: progress(10, entered_sync=9)}))
    assert group.killed == [1]
    assert [e["kind"] for e in group.events("worker_failed")] == ["unreachable"]


def test_a_member_connecting_a_generation_whose_peer_died_after_the_barrier_is_not_blamed():
    # Two deaths within milliseconds: the second lands after generation 1's "go", so the survivor
    # waits in gloo's connect for the dead peer (up to its connect deadline) while generation 2 is
    # offered. Past the hang deadline it has not come to generation 2, but it is waiting, not hung.
    group = FakeWorkerGroup(min_workers=1)
    group.start_run(0, 1, 2)
    group.die(1)
    group.die(2)
    offered = group.latest_offer.formation.generation
    group.send(Tick(last_step_at=group.now, deadline_s=2.0, reach_deadline_s=0.5), after_s=3.0)
    group.send(ProbesRead({0: progress(14, arrived=offered - 1, connected=offered - 2)}))
    assert group.killed == [] and group.state != "FAILED"


def test_an_unreachable_member_of_a_heal_aborts_it_and_the_next_offer_leaves_it_out():
    group = FakeWorkerGroup(min_workers=1)
    group.start_run(0, 1, 2)
    group.die(2)
    heal = group.latest_offer.formation
    group.form(members=(0,))
    group.send(Tick(last_step_at=group.now, deadline_s=10.0, reach_deadline_s=0.5), after_s=1.0)
    group.send(ProbesRead({0: progress(), 1: None}))
    assert heal.generation in group.aborted
    assert group.latest_offer.formation.members == (0,) and group.latest_offer.formation.generation > heal.generation


def test_a_ping_that_every_member_answers_neither_kills_nor_postpones_the_hang_deadline():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    last_step = group.now
    group.send(Tick(last_step_at=last_step, deadline_s=5.0, reach_deadline_s=0.5), after_s=1.0)
    group.send(ProbesRead({0: progress(10), 1: progress(10, entered_sync=9), 2: progress(10)}))
    assert group.killed == [], "short of the hang deadline a member that answers is left alone"
    group.send(Tick(last_step_at=last_step, deadline_s=5.0, reach_deadline_s=0.5), after_s=0.2)
    assert len(group.polls) == 1, "pinged again before another reach deadline passed"
    group.send(Tick(last_step_at=last_step, deadline_s=5.0, reach_deadline_s=0.5), after_s=4.5)
    group.send(ProbesRead({0: progress(10), 1: progress(10, entered_sync=9), 2: progress(10)}))
    assert group.killed == [1] and group.events("worker_failed")[-1]["kind"] == "hang"


def test_the_recovery_from_an_unreachable_member_counts_from_the_last_committed_step():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(Tick(last_step_at=group.now, deadline_s=10.0, reach_deadline_s=0.5), after_s=0.75)
    group.send(ProbesRead({0: progress(), 1: None, 2: progress()}), after_s=1.0)
    group.form(step=10)
    [recovery] = group.events("recovery")
    assert recovery["detect_s"] == pytest.approx(0.75 + 1.0), "the stall until the ping, and the ping"
    assert recovery["seconds"] > recovery["detect_s"], "the survivors stood still from the last commit on"


# --- the network: a partial partition ------------------------------------------------------------
def _at(address, silent=None):
    """A member's answer from `address`: waiting in the all-reduce, its links to the peers in `silent`
    unacknowledged for so many seconds."""
    return dataclasses.replace(progress(10, entered_sync=10), address=address, silent=silent or {})


def test_a_member_cut_off_from_its_peers_while_all_answer_is_healed_around_and_the_waiters_are_not_blamed():
    # Rank 1's node and the other two stopped reaching each other; every node still reaches the
    # controller. Ranks 0 and 1 each see their sends to the next rank of the ring go unacknowledged.
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(Tick(last_step_at=group.now, deadline_s=10.0, reach_deadline_s=0.5), after_s=1.5)
    group.send(ProbesRead({0: _at("10.0.0.1", {"10.0.0.2": 1.4}), 1: _at("10.0.0.2", {"10.0.0.3": 1.2}),
                               2: _at("10.0.0.3")}))
    assert group.killed == [1]
    [failed] = group.events("worker_failed")
    assert failed["kind"] == "cut_off" and "10.0.0.2" in failed["cause"]
    assert group.latest_offer.formation.reason == Reason.HEAL and group.latest_offer.formation.members == (0, 2)
    assert group.protocol.fenced(1)
    group.form(step=10)
    [recovery] = group.events("recovery")
    assert recovery["detect_s"] >= 1.5, "the survivors stood still from the last commit on"


def test_links_silent_for_less_than_link_silence_s_blame_nobody_yet():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(Tick(last_step_at=group.now, deadline_s=10.0, reach_deadline_s=0.5), after_s=0.6)
    group.send(ProbesRead({0: _at("10.0.0.1", {"10.0.0.2": 0.5}), 1: _at("10.0.0.2"), 2: _at("10.0.0.3")}))
    assert group.killed == [] and not group.events("worker_failed")


def test_two_members_cut_from_each_other_lose_the_higher_rank_only():
    group = FakeWorkerGroup(min_workers=1)
    group.start_run(0, 1)
    group.send(Tick(last_step_at=group.now, deadline_s=10.0, reach_deadline_s=0.5), after_s=1.5)
    group.send(ProbesRead({0: _at("10.0.0.1", {"10.0.0.2": 1.4}), 1: _at("10.0.0.2", {"10.0.0.1": 1.4})}))
    assert group.killed == [1] and group.latest_offer.formation.members == (0,)


def test_members_that_all_answer_and_are_alike_are_not_killed_before_the_ceiling():
    group = FakeWorkerGroup(hang_ceiling_s=60)
    group.start_run(0, 1, 2)
    group.send(Tick(deadline_s=5.0), after_s=10.0)
    group.send(ProbesRead({0: progress(), 1: progress(), 2: progress()}))
    assert group.killed == []


def test_a_checkpoint_upload_holding_the_run_up_is_progress_not_a_hang():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(Tick(deadline_s=1.0), after_s=2.0)
    group.send(ProbesRead({0: progress(checkpointing=True), 1: progress(entered_sync=3), 2: progress()}))
    assert group.killed == []
    assert group.send(Tick(deadline_s=1.0), after_s=0.5) == [], "the upload did not count as progress"


def test_during_a_formation_only_the_member_that_never_reached_the_barrier_is_hung():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(GroupBroken(0, generation=0))
    group.form(members=(0,))
    group.send(Tick(deadline_s=1.0), after_s=2.0)
    assert group.polls[-1].members == (0, 1, 2)
    group.send(ProbesRead({0: progress(arrived=1), 1: progress(arrived=1), 2: progress(arrived=0)}))
    assert group.killed == [2]


def test_a_straggler_is_evicted_with_its_reason():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(Straggling(2, "its compute took 3x the others' median"))
    assert group.killed == [2]
    assert group.events("decision")[-1]["action"] == "EVICT"
    # Lost at once: the heal is offered before its kill lands, and a survivor's collective that
    # breaks meanwhile (the evicted one still sends) never brings it back into a formation.
    assert group.latest_offer.formation.members == (0, 1)
    group.send(GroupBroken(1, generation=0))
    group.die(2)
    assert all(2 not in offer.formation.members for offer in group.offers.values() if offer.formation.generation > 0)
    assert [e["kind"] for e in group.events("worker_failed")] == ["straggler"]


# --- finishing --------------------------------------------------------------------------------------
def test_the_run_finishes_when_every_member_ended_and_returns_rank_0s_value():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.finish(1, value="one")
    assert group.state == "FINISHING"
    group.finish(0, value="zero")
    group.finish(2, value="two")
    assert group.state == "FINISHED" and group.protocol.rank0_outcome().value == "zero"


def test_a_worker_that_finishes_before_any_generation_was_offered_fails_the_run_instead_of_finishing_it():
    group = FakeWorkerGroup(min_workers=2, max_workers=2)
    group.finish(0, value="trained alone")
    assert group.state == "FAILED" and not group.offers
    assert "before any generation was offered" in group.protocol.state.error


def test_a_finishing_run_aborts_a_pending_grow():
    group = _grown_to_prepare(FakeWorkerGroup(min_workers=1, max_workers=3))
    group.answer_prepare({0: 40, 1: 40})
    group.finish(0)
    assert group.aborted == [1] and group.state == "FINISHING"
    group.die(1)
    assert group.state == "FINISHED"


def test_a_group_that_keeps_breaking_with_every_member_alive_is_a_crash_loop():
    group = FakeWorkerGroup(max_heals_without_step=2)
    group.start_run(0, 1, 2)
    for _ in range(3):
        group.send(GroupBroken(0, generation=group.protocol.running))
        if group.state == "FAILED":
            break
        group.form()
    assert group.state == "FAILED" and group.protocol.state.kind == "crash_loop"
    assert group.killed == [], "nobody died, so nobody is killed"


def test_every_member_blocked_in_a_collective_past_the_deadline_is_an_application_error():
    group = FakeWorkerGroup(max_failures=0)
    group.start_run(0, 1, 2)
    group.send(Tick(deadline_s=5.0), after_s=10.0)
    where = "all_reduce called from train_loop at train.py:42"
    blocked = ProbeReading(step=10, entered_sync=10, launched=10, arrived=0, connected=0, checkpointing=False, blocked_in=where)
    group.send(ProbesRead({0: blocked, 1: blocked, 2: blocked}))
    assert group.state == "FAILED" and group.protocol.state.kind == "app_error"
    assert where in group.protocol.state.error and group.protocol.failures == 1


def test_a_shard_upload_finishing_counts_as_progress_for_the_hang_check():
    group = FakeWorkerGroup()
    group.start_run(0, 1, 2)
    group.send(ShardWritten(0, step=16), after_s=9.0)
    assert group.send(Tick(deadline_s=5.0), after_s=1.0) == []
    assert group.send(Tick(deadline_s=5.0), after_s=5.0) != [], "the stall clock never started again"


# --- replicas of pipeline stages: the elastic unit -------------------------------------------
def replicas(**kwargs):
    """Two replicas of 2 stages at most, one at least: workers 0-1 are replica 0, 2-3 replica 1."""
    return FakeWorkerGroup(min_workers=2, max_workers=4, pipeline_stages=2, **kwargs)


def test_workers_are_started_in_whole_replicas():
    group = replicas()
    assert group.started == [0, 1, 2, 3]
    assert group.protocol.workers[2].status == Status.STARTING


def test_a_death_in_a_replica_still_starting_takes_its_mate_and_asks_for_a_whole_new_one():
    group = replicas()
    group.ready(0, 1, 2)
    group.die(3)
    assert group.killed == [2] and group.protocol.workers[2].status == Status.GONE
    assert group.started == [0, 1, 2, 3, 4, 5]
    group.send(Tick(), after_s=group.protocol.scaling.start_grace_s + 0.1)
    assert group.latest_offer.formation.members == (0, 1)


def test_a_newcomer_replica_that_loses_a_worker_during_its_grow_is_aborted_and_the_run_goes_on():
    group = replicas()
    group.start_run(0, 1)
    group.ready(2, 3)
    generation = max(group.prepares)
    group.die(2)
    assert generation in group.aborted and group.killed == [3]
    assert group.state == "RUNNING" and group.protocol.members == (0, 1) and not group.protocol.broken


def test_a_replica_joins_only_when_all_of_its_workers_are_ready():
    group = replicas()
    group.ready(0, 1, 3)
    group.send(Tick(), after_s=group.protocol.scaling.start_grace_s + 0.1)
    assert group.latest_offer.formation.members == (0, 1), "a replica missing a worker formed"
    group.form()
    group.ready(2)
    assert group.prepares, "the replica whose workers are all ready did not join"
    group.answer_prepare({0: 5, 1: 5})
    assert group.latest_offer.formation.members == (0, 1, 2, 3)


def test_a_death_takes_out_its_replica_and_the_other_heals_in_place():
    group = replicas()
    group.start_run(0, 1, 2, 3)
    group.die(3)
    assert group.killed == [2], "the dead worker's replica-mate was not taken out"
    assert [e["worker_id"] for e in group.events("worker_failed") if e["kind"] == "replica"] == [2]
    offer = group.latest_offer
    assert offer.formation.members == (0, 1) and offer.formation.reason == Reason.HEAL and not offer.restart
    assert group.started == [0, 1, 2, 3, 4, 5], "no new replica was requested"
    group.die(2)  # the killed mate's death arrives: nothing more happens
    assert group.killed == [2] and group.latest_offer is offer


def test_a_new_replica_grows_the_healed_run_back():
    group = replicas()
    group.start_run(0, 1, 2, 3)
    group.die(1)
    group.form(step=9)
    group.ready(4, 5)
    group.answer_prepare({2: 10, 3: 10})
    assert group.latest_offer.formation.members == (2, 3, 4, 5)
    assert group.latest_offer.formation.reason == Reason.GROW


def test_losing_every_replica_restarts_from_the_checkpoint_with_new_ones():
    group = replicas(max_failures=1)
    group.start_run(0, 1, 2, 3)
    group.die(0)
    group.die(2)
    assert sorted(group.killed) == [1, 3]
    group.ready(4, 5)
    assert group.latest_offer.formation.members == (4, 5) and group.latest_offer.restart


def test_a_hung_worker_is_evicted_with_its_replica_and_a_mate_already_evicted_is_not_killed_twice():
    group = replicas()
    group.start_run(0, 1, 2, 3)
    group.send(Tick(last_step_at=group.now - 6, deadline_s=5.0), after_s=6.0)
    group.send(ProbesRead({0: progress(10), 1: progress(10), 2: progress(10), 3: progress(10, entered_sync=9)}))
    # Given up on, it is lost at once with its replica: both killed, the heal offered without waiting for the kill.
    assert group.killed == [3, 2] and group.latest_offer.formation.members == (0, 1)
    offers = len(group.offers)
    group.die(3)
    assert group.killed == [3, 2] and len(group.offers) == offers, "the hung worker's death was healed twice"
    # Every member evicted at once (a collective deadlock): each death releases mates already killed.
    group = replicas(max_failures=1)
    group.start_run(0, 1, 2, 3)
    group.send(Tick(last_step_at=group.now - 6, deadline_s=5.0), after_s=6.0)
    blocked = ProbeReading(step=10, entered_sync=10, launched=10, arrived=0, connected=0, checkpointing=False,
                             blocked_in="all_reduce at loop.py:3")
    group.send(ProbesRead({w: blocked for w in range(4)}))
    assert sorted(group.killed) == [0, 1, 2, 3]
    for worker_id in range(4):
        group.die(worker_id)
    assert sorted(group.killed) == [0, 1, 2, 3], "a worker was killed twice"
    assert len(group.events("worker_failed")) == 4


def test_each_offer_carries_a_connect_deadline_from_the_last_connect_that_doubles_while_formations_fail():
    group = FakeWorkerGroup(min_workers=1)
    group.ready(0, 1, 2)
    group.send(Tick(), after_s=group.protocol.scaling.start_grace_s + 0.1)
    assert group.latest_offer.connect_timeout_s == CONNECT_CEILING_S  # the run's first connect
    reports = group.formed_reports()
    reports[1] = dataclasses.replace(reports[1], timings={"connect_s": 0.04, "sync_s": 0.01})
    group.deliver(reports)
    group.die(2)
    assert group.latest_offer.connect_timeout_s == pytest.approx(0.16)  # 4 times the slowest member's
    healing = group.latest_offer.formation.generation
    group.send(FormedReport(0, healing, ok=False, error="RuntimeError: Connect timeout"))
    assert group.latest_offer.formation.generation > healing
    assert group.latest_offer.connect_timeout_s == pytest.approx(0.32)


def test_an_nccl_run_connects_within_the_ceiling_its_derived_deadline_untried_on_gpus():
    protocol = Protocol(ScalingConfig(min_workers=1, max_workers=1, use_gpu=True), FailureConfig(), MAX_STEPS)
    protocol.connect_s = 0.01  # a connect measured: a gloo run's next offer would get 0.1 s
    protocol.start(0.0)
    [offer] = [a for a in protocol.step(WorkerReady(0, "n", 1), 1.0) if isinstance(a, Offer)]
    assert offer.connect_timeout_s == CONNECT_CEILING_S
