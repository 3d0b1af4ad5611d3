"""Each detector of the controller (`elastic/controller/detectors.py`) as the pure object it is:
time, probe readings and step reports in, a finding or None out. No protocol, no Ray."""

import dataclasses

import pytest

from elastic.controller.detectors import HangCheck, PartitionCheck, Poll, ReachCheck, StallWatch, StragglerCheck
from elastic.controller.signals import CutOff, Deadlocked, Hung, ProbeReading, Straggling, Unreachable
from elastic.controller.states import Formation, Forming, Reason

HANG_S, REACH_S = 5.0, 0.5


def reading(step=10, entered_sync=None, arrived=-1, connected=None, checkpointing=False, blocked_in="",
            address="", silent=None):
    entered = step if entered_sync is None else entered_sync
    return ProbeReading(step=step, entered_sync=entered, launched=entered, arrived=arrived,
                        checkpointing=checkpointing, blocked_in=blocked_in,
                        connected=arrived if connected is None else connected, address=address,
                        silent=silent or {})


def watch_since(progress_at: float) -> StallWatch:
    watch = StallWatch()
    watch.progressed(progress_at)
    return watch


# --- StallWatch: when to poll ------------------------------------------------------------------
def test_the_watch_pings_past_the_reach_deadline_and_judges_only_past_the_hang_deadline():
    watch = watch_since(0.0)
    assert watch.tick(0.4, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S) is None
    ping = watch.tick(0.6, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S)
    assert ping == Poll(sent_at=0.6, stalled_since=0.0, hang=False, deadline_s=HANG_S)
    assert watch.answered(0.7) == ping
    judgement = watch.tick(5.5, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S)
    assert judgement.hang and judgement.stalled_s == pytest.approx(5.5)


def test_a_ping_that_was_answered_never_postpones_the_hang_deadline():
    watch = watch_since(0.0)
    watch.tick(0.6, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S)
    watch.answered(0.7)
    assert watch.progress_at == 0.0
    assert watch.tick(0.9, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S) is None, \
        "pinged again before another reach deadline passed"
    judgement = watch.tick(5.1, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S)
    assert judgement.hang and judgement.stalled_since == 0.0


def test_only_one_poll_is_under_way_at_a_time():
    watch = watch_since(0.0)
    assert watch.tick(6.0, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S) is not None
    assert watch.tick(20.0, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S) is None
    assert watch.answered(20.1) is not None and watch.answered(20.2) is None, "answers nobody asked for"


def test_a_hang_judgement_starts_the_stall_clock_again_so_the_next_is_a_whole_deadline_away():
    watch = watch_since(0.0)
    watch.tick(6.0, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S)
    watch.answered(6.1)
    poll = watch.tick(7.0, last_step_at=0.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S)
    assert not poll.hang and poll.stalled_since == 6.1


def test_a_committed_step_or_other_progress_holds_the_polls_off():
    watch = watch_since(0.0)
    assert watch.tick(3.3, last_step_at=3.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S) is None
    watch.progressed(4.0)  # a checkpoint shard written, say
    assert watch.tick(4.4, last_step_at=3.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S) is None
    assert watch.tick(4.6, last_step_at=3.0, hang_deadline_s=HANG_S, reach_deadline_s=REACH_S).stalled_since == 4.0


# --- ReachCheck: unreachable members --------------------------------------------------------------
POLL = Poll(sent_at=11.0, stalled_since=10.0, hang=False, deadline_s=HANG_S)


def test_a_member_that_answered_no_ping_is_unreachable_for_as_long_as_the_run_stood_still():
    found = ReachCheck(ping_timeout_s=1.0).read(POLL, {0: reading(), 1: None, 2: reading()}, gone=set(), now=12.0)
    assert found == Unreachable((1,), "answered no ping within FailureConfig(ping_timeout_s=1.0)", 10.0, 2.0)


def test_a_poll_that_nobody_answered_blames_nobody():
    assert ReachCheck(ping_timeout_s=1.0).read(POLL, {0: None, 1: None}, gone=set(), now=12.0) is None


def test_a_member_lost_while_the_poll_was_out_is_not_called_unreachable():
    assert ReachCheck(ping_timeout_s=1.0).read(POLL, {0: reading(), 1: None}, gone={1}, now=12.0) is None


# --- PartitionCheck: a partial partition ------------------------------------------------------------
def test_a_member_cut_off_from_its_peers_is_found_and_its_waiters_are_not():
    # Ranks 0 and 1 each see their sends to the next rank of the ring go unacknowledged.
    answers = {0: reading(address="10.0.0.1", silent={"10.0.0.2": 1.4}),
               1: reading(address="10.0.0.2", silent={"10.0.0.3": 1.2}), 2: reading(address="10.0.0.3")}
    found = PartitionCheck(link_silence_s=1.0).read(POLL, (0, 1, 2), answers, now=12.0)
    assert isinstance(found, CutOff) and found.workers == (1,)
    assert "10.0.0.1 -> 10.0.0.2" in found.reason and "10.0.0.2 -> 10.0.0.3" in found.reason
    assert "link_silence_s=1.0" in found.cause and found.detect_s == 2.0


def test_links_silent_for_less_than_link_silence_s_or_a_member_silent_to_the_controller_cut_nobody():
    check = PartitionCheck(link_silence_s=1.0)
    short = {0: reading(address="10.0.0.1", silent={"10.0.0.2": 0.5}), 1: reading(address="10.0.0.2")}
    assert check.read(POLL, (0, 1), short, now=12.0) is None
    unanswered = {0: reading(address="10.0.0.1", silent={"10.0.0.2": 1.4}), 1: None}
    assert check.read(POLL, (0, 1), unanswered, now=12.0) is None, "the reach check's case, not a partition's"


def test_of_two_members_cut_from_each_other_the_higher_rank_is_cut_off():
    answers = {7: reading(address="10.0.0.1", silent={"10.0.0.2": 1.4}),
               3: reading(address="10.0.0.2", silent={"10.0.0.1": 1.4})}
    assert PartitionCheck(link_silence_s=1.0).read(POLL, (7, 3), answers, now=12.0).workers == (3,)


# --- HangCheck: members behind their peers ------------------------------------------------------------
JUDGEMENT = Poll(sent_at=16.0, stalled_since=10.0, hang=True, deadline_s=HANG_S)


def test_the_member_behind_its_peers_past_the_hang_deadline_is_hung():
    found = HangCheck(hang_ceiling_s=60).read(JUDGEMENT, {0: reading(), 1: reading(entered_sync=9), 2: reading()},
                                              forming=None)
    assert isinstance(found, Hung) and list(found.causes) == [1]
    assert found.detect_s == 6.0 and found.deadline_s == HANG_S


def test_a_checkpoint_upload_or_a_connect_under_way_is_never_a_hang():
    check = HangCheck(hang_ceiling_s=60)
    uploading = {0: reading(checkpointing=True), 1: reading(entered_sync=3)}
    assert check.read(JUDGEMENT, uploading, forming=None) is None
    connecting = {0: reading(step=14, arrived=5, connected=4)}
    assert check.read(JUDGEMENT, connecting, forming=None) is None


def test_members_alike_that_all_answer_are_hung_only_past_the_ceiling():
    alike = {0: reading(), 1: reading()}
    assert HangCheck(hang_ceiling_s=60).read(JUDGEMENT, alike, forming=None) is None
    assert list(HangCheck(hang_ceiling_s=6).read(JUDGEMENT, alike, forming=None).causes) == [0, 1]


def test_every_member_blocked_in_a_collective_is_a_deadlock_that_names_where():
    where = "all_reduce called from train_loop at train.py:42"
    blocked = {w: reading(blocked_in=where) for w in range(3)}
    found = HangCheck(hang_ceiling_s=60).read(JUDGEMENT, blocked, forming=None)
    assert isinstance(found, Deadlocked) and where in found.cause and "6.0 s" in found.cause


def test_during_a_formation_only_a_member_that_never_came_to_its_barrier_is_hung_even_when_alike():
    formation = Formation(1, (0, 1, 2), Reason.HEAL, "heal", since=10.0)
    forming = Forming(formation, acked={0: object()})
    answers = {0: reading(arrived=1), 1: reading(arrived=1), 2: reading(arrived=0)}
    assert list(HangCheck(hang_ceiling_s=60).read(JUDGEMENT, answers, forming).causes) == [2]
    waiting = {0: reading(arrived=1), 1: reading(arrived=1)}
    assert HangCheck(hang_ceiling_s=60).read(JUDGEMENT, waiting, forming) is None


# --- StragglerCheck: slow compute, slow links ------------------------------------------------------
STEADY = {s: 1.0 for s in range(10)}
MBIT = 1e6 / 8  # bytes per second


def test_a_member_slow_to_compute_in_each_recent_step_is_a_straggler():
    slow = {s: (4.0 if s >= 5 else 1.0) for s in range(10)}
    found = StragglerCheck(factor=3, steps=5).read({0: STEADY, 1: slow, 2: STEADY}, link_rates={})
    assert isinstance(found, Straggling) and found.worker_id == 1 and "straggler_factor=3" in found.reason
    assert StragglerCheck(factor=3, steps=6).read({0: STEADY, 1: slow, 2: STEADY}, link_rates={}) is None


def test_with_compute_alike_a_node_whose_every_link_is_slow_is_the_straggler():
    rates = {10: ("198.18.0.2", {"198.18.0.3": 9000 * MBIT}), 11: ("198.18.0.3", {"198.18.0.4": 95 * MBIT}),
             12: ("198.18.0.4", {"198.18.0.2": 97 * MBIT})}
    compute = {10: STEADY, 11: STEADY, 12: STEADY}
    found = StragglerCheck(factor=4, steps=5).read(compute, rates)
    assert found.worker_id == 12 and found.reason.startswith("the network")
    assert StragglerCheck(factor=200, steps=5).read(compute, rates) is None


def test_findings_are_frozen():
    found = StragglerCheck(factor=3, steps=5).read({0: STEADY, 1: {s: 9.0 for s in range(10)}, 2: STEADY}, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.worker_id = 0
