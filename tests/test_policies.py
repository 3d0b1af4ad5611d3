"""The controller's decisions are pure functions; each rule is checked directly."""

from elastic.policies import NoopDecision, ResizeDecision, WaitDecision, decide_failure, decide_membership, workers_to_start


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
