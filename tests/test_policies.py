"""The controller's decisions are pure functions; each rule is checked directly."""

import pytest

from elastic.controller.policies import (
    CONNECT_CEILING_S, NoopDecision, ResizeDecision, WaitDecision, connect_deadline, decide_failure,
    decide_membership, find_cut_off, reach_deadline, workers_to_start,
)


def test_a_dead_worker_is_healed_and_not_counted_as_a_failure():
    assert decide_failure("death", failures=0, max_failures=0).action == "HEAL"


def test_application_errors_are_tolerated_up_to_max_failures_then_raise():
    assert decide_failure("app_error", failures=1, max_failures=1).action == "HEAL"
    decision = decide_failure("app_error", failures=2, max_failures=1)
    assert decision.action == "RAISE"
    assert "(2) > FailureConfig(max_failures=1)" in decision.reason


def test_the_first_generation_takes_every_ready_worker_up_to_max():
    decision = decide_membership([], [0, 1, 2, 3], generation_broken=True, min_workers=2, max_workers=3)
    assert decision == ResizeDecision((0, 1, 2), "start: 3 ready workers")


def test_a_broken_generation_heals_with_survivors_first_so_ranks_move_least():
    decision = decide_membership([2, 0], [5], generation_broken=True, min_workers=2, max_workers=4)
    assert isinstance(decision, ResizeDecision) and decision.members == (2, 0, 5)


def test_ready_newcomers_grow_a_healthy_generation_up_to_max_workers():
    decision = decide_membership([0, 1], [4, 5], generation_broken=False, min_workers=1, max_workers=3)
    assert isinstance(decision, ResizeDecision) and decision.members == (0, 1, 4)
    assert decide_membership([0, 1, 2], [4], False, 1, 3) == NoopDecision()


def test_below_min_workers_the_decision_is_to_wait():
    decision = decide_membership([0], [], generation_broken=True, min_workers=2, max_workers=3)
    assert isinstance(decision, WaitDecision) and "min_workers(2)" in decision.reason


def test_workers_are_requested_until_live_plus_pending_reach_max():
    assert workers_to_start(live=1, max_workers=3) == 2
    assert workers_to_start(live=4, max_workers=3) == 0


def test_the_stall_deadline_follows_the_median_step_within_floor_and_ceiling():
    from elastic.controller.policies import hang_deadline

    assert hang_deadline([0.1] * 3, factor=20, floor_s=1, ceiling_s=60) == 60  # too few steps measured yet
    assert hang_deadline([0.1] * 10, factor=20, floor_s=1, ceiling_s=60) == pytest.approx(2.0)
    assert hang_deadline([0.01] * 10, factor=20, floor_s=1, ceiling_s=60) == 1
    assert hang_deadline([10.0] * 10, factor=20, floor_s=1, ceiling_s=60) == 60


def test_the_hung_member_is_the_one_behind_or_silent():
    from elastic.controller.policies import find_hung

    # Peers entered the gradient sync of step 10 that member 1 never reached.
    assert find_hung({0: (10, 11, 0), 1: (10, 10, 0), 2: (10, 11, 0)}) == [1]
    assert find_hung({0: (10, 11, 0), 1: None}) == [1]
    assert find_hung({0: (10, 11, 5), 1: (10, 11, 4)}) == [1]  # entered alike; launched fewer
    assert find_hung({0: (10, 11, 0), 1: (10, 11, 0)}) == [0, 1]  # all stuck alike: the whole generation


def test_a_straggler_is_a_member_slower_than_the_others_in_every_recent_step():
    from elastic.controller.policies import find_straggler

    steady = {s: 1.0 for s in range(10)}
    slow = {s: (4.0 if s >= 5 else 1.0) for s in range(10)}
    member, reason = find_straggler({0: steady, 1: slow, 2: steady}, factor=3, steps=5)
    assert member == 1 and "straggler_factor=3" in reason
    assert find_straggler({0: steady, 1: slow, 2: steady}, factor=3, steps=6) is None  # not slow for 6 steps yet
    assert find_straggler({0: steady, 1: steady}, factor=3, steps=5) is None


MBIT = 1e6 / 8  # bytes per second


def test_a_node_whose_every_link_is_slow_is_a_network_straggler_and_its_compute_is_quoted():
    from elastic.controller.policies import find_slow_link

    # A ring of three nodes: 0 -> 1 -> 2 -> 0. Node 2's link carries 100 Mbit/s both ways, so
    # the connections into and out of it are slow; 0 -> 1, between the others, is not.
    rates = {10: ("198.18.0.2", {"198.18.0.3": 9000 * MBIT}),
             11: ("198.18.0.3", {"198.18.0.4": 95 * MBIT}),
             12: ("198.18.0.4", {"198.18.0.2": 97 * MBIT})}
    compute = {10: {5: 0.05}, 11: {5: 0.05}, 12: {5: 0.05}}
    member, reason = find_slow_link(rates, compute, factor=4)
    assert member == 12
    assert reason.startswith("the network") and "198.18.0.4" in reason and "97 Mbit/s" in reason
    assert "9000 Mbit/s" in reason and "straggler_factor=4" in reason and "compute took 1.0x" in reason
    assert find_slow_link(rates, compute, factor=200) is None, "a ratio below the factor evicts nobody"


def test_a_slow_link_between_two_nodes_names_neither_and_a_fast_burst_counts_as_fast():
    from elastic.controller.policies import find_slow_link

    two = {0: ("198.18.0.2", {"198.18.0.3": 90 * MBIT}), 1: ("198.18.0.3", {"198.18.0.2": 90 * MBIT})}
    assert find_slow_link(two, {}, factor=2) is None
    # A connection whose burst the kernel's busy clock did not see is fast (an infinite rate).
    ring = {0: ("198.18.0.2", {"198.18.0.3": float("inf")}), 1: ("198.18.0.3", {"198.18.0.4": 50 * MBIT}),
            2: ("198.18.0.4", {"198.18.0.2": 50 * MBIT})}
    member, reason = find_slow_link(ring, {}, factor=2)
    assert member == 2 and "too short to time" in reason
    same_node = {0: ("198.18.0.2", {"198.18.0.2": 1 * MBIT}), 1: ("198.18.0.2", {"198.18.0.2": 1 * MBIT})}
    assert find_slow_link(same_node, {}, factor=2) is None, "connections within a node are not a link"


def test_a_node_is_avoided_after_repeated_failures_until_they_age_out():
    from elastic.controller.policies import nodes_to_avoid

    failures = {"a": [100.0, 150.0, 190.0], "b": [190.0]}
    alive = {"a", "b"}
    assert nodes_to_avoid(failures, now=200.0, limit=3, cooldown_s=300, alive=alive) == {"a"}
    assert nodes_to_avoid(failures, now=460.0, limit=3, cooldown_s=300, alive=alive) == set()  # aged out
    assert nodes_to_avoid(failures, now=200.0, limit=3, cooldown_s=300, alive={"a"}) == set()  # the only node


def test_members_are_pinged_after_1_2_median_steps_within_the_floor_and_the_ceiling():
    assert reach_deadline([0.05] * 10, floor_s=0.5, ceiling_s=1.0) == 0.5  # fast steps: the floor
    assert reach_deadline([0.6] * 10, floor_s=0.5, ceiling_s=1.0) == pytest.approx(0.72)
    # Slow steps: pinged every second of a 3 s step, so a node cut off inside it is seen within
    # about ceiling + ping timeout, not 1.2 steps after the last commit.
    assert reach_deadline([3.0] * 10, floor_s=0.5, ceiling_s=1.0) == 1.0
    assert reach_deadline([3.0], floor_s=0.5, ceiling_s=1.0) == 0.5  # not measured yet


def test_a_connect_gets_4_times_the_last_within_the_floor_doubling_per_failure_up_to_the_ceiling():
    assert connect_deadline(None, 0, floor_s=0.1) == CONNECT_CEILING_S  # fresh processes: no connect measured
    assert connect_deadline(0.005, 0, floor_s=0.1) == 0.1  # loopback connects: the floor
    assert connect_deadline(0.05, 0, floor_s=0.1) == pytest.approx(0.2)
    assert connect_deadline(0.005, 2, floor_s=0.1) == pytest.approx(0.4)  # two generations failed to form
    assert connect_deadline(0.005, 6, floor_s=0.1) == CONNECT_CEILING_S
    assert connect_deadline(2.0, 0, floor_s=0.1) == CONNECT_CEILING_S


# --- a partial partition: the smallest set of members that explains every cut link ----------------
THREE = {10: "10.0.0.1", 11: "10.0.0.2", 12: "10.0.0.3"}


def test_a_member_cut_from_both_others_is_the_whole_cover_whichever_links_saw_it():
    assert find_cut_off(THREE, {10: {"10.0.0.2": 2.0}, 11: {"10.0.0.3": 2.0}}, silence_s=1.0) == [11]
    assert find_cut_off(THREE, {12: {"10.0.0.2": 2.0}, 10: {"10.0.0.2": 2.0}}, silence_s=1.0) == [11]


def test_one_cut_link_loses_the_higher_rank_and_a_short_silence_nobody():
    assert find_cut_off(THREE, {10: {"10.0.0.2": 2.0}}, silence_s=1.0) == [11]
    assert find_cut_off(THREE, {10: {"10.0.0.2": 0.9}}, silence_s=1.0) == []
    assert find_cut_off(THREE, {10: {"10.0.0.9": 5.0}}, silence_s=1.0) == [], "an address of no member is no member's cut"


def test_a_cut_takes_every_member_behind_an_address_and_prefers_the_address_with_fewer():
    # Two members on 10.0.0.1, one on 10.0.0.2, cut from each other: losing one member beats losing two.
    members = {1: "10.0.0.1", 2: "10.0.0.1", 3: "10.0.0.2", 4: "10.0.0.3"}
    assert find_cut_off(members, {1: {"10.0.0.2": 3.0}, 3: {"10.0.0.1": 3.0}}, silence_s=1.0) == [3]
    # Cut from both other addresses, the two members on 10.0.0.1 go together.
    assert find_cut_off(members, {1: {"10.0.0.2": 3.0}, 2: {"10.0.0.3": 3.0}}, silence_s=1.0) == [1, 2]


def test_the_greedy_cover_of_many_addresses_still_finds_the_hub():
    members = {w: f"10.0.1.{w}" for w in range(20)}
    silent = {w: {"10.0.1.7": 4.0} for w in range(20) if w != 7}
    assert find_cut_off(members, silent, silence_s=1.0) == [7]
