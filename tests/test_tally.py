"""The controller's tally (`RunTally`): productive time for goodput, and link rates over
the last steps, from the workers' cumulative link samples (`elastic.comm.links.GroupLinks.traffic`)."""

import pytest

from elastic.controller.tally import LINK_MIN_BYTES, STALL_FACTOR, RunTally

MB = 1 << 20


def _links(generation, step, sent):
    return {"kind": "links", "generation": generation, "step": step, "address": "198.18.0.2", "sent": sent}


def test_link_rates_are_the_bytes_per_busy_second_of_the_last_steps_of_the_current_generation():
    tally = RunTally(max_steps=100)
    tally.ingest(0, [_links(1, 0, {"198.18.0.3": (1 * MB, 0.1)})])
    tally.ingest(0, [_links(1, 10, {"198.18.0.3": (11 * MB, 1.1)})])
    tally.ingest(0, [_links(1, 20, {"198.18.0.3": (31 * MB, 1.6), "198.18.0.4": (MB, 0.5)})])
    # Over the last 10 steps: 20 MB in 0.5 busy seconds; 198.18.0.4 is new since step 10 but sent enough.
    [(address, rates)] = tally.link_rates([0], steps=10).values()
    assert address == "198.18.0.2"
    assert rates["198.18.0.3"] == 20 * MB / 0.5 and rates["198.18.0.4"] == MB / 0.5
    # Over the last 20 steps: 30 MB in 1.5 s; not yet 21 steps of samples.
    assert tally.link_rates([0], steps=20)[0][1]["198.18.0.3"] == 30 * MB / 1.5
    assert tally.link_rates([0], steps=21) == {}


def test_a_new_generation_and_control_chatter_are_not_judged_and_a_verdict_forgets_the_samples():
    tally = RunTally(max_steps=100)
    tally.ingest(0, [_links(1, 0, {"198.18.0.3": (0, 0.0)})])
    tally.ingest(0, [_links(2, 30, {"198.18.0.3": (4 * MB, 0.0)})])
    assert tally.link_rates([0], steps=10) == {}, "steps of generation 1 judged generation 2"
    tally.ingest(0, [_links(2, 40, {"198.18.0.3": (4 * MB + LINK_MIN_BYTES - 1, 0.2)})])
    assert tally.link_rates([0], steps=10) == {0: ("198.18.0.2", {})}, "control messages read as a link's rate"
    tally.ingest(0, [_links(2, 50, {"198.18.0.3": (9 * MB, 0.2)})])
    assert tally.link_rates([0], steps=10)[0][1] == {"198.18.0.3": float("inf")}, "an untimed burst is fast"
    tally.forget_stragglers()
    assert tally.link_rates([0], steps=10) == {}


def _step(step, step_s):
    return {"kind": "step", "step": step, "rank": 0, "world_size": 2, "generation": 0, "step_s": step_s,
            "compute_s": None, "samples": 64, "time": 1000.0 + step}


def test_a_step_that_stood_still_counts_one_median_step_as_productive_whatever_ended_the_stall():
    tally = RunTally(max_steps=100)
    tally.ingest(0, [_step(step, 0.3) for step in range(10)])
    assert tally.productive_s == pytest.approx(3.0)
    tally.ingest(0, [_step(10, 107.0)])  # a collective that waited on a cut link until the link came back
    assert tally.productive_s == pytest.approx(3.3)
    tally.ingest(0, [_step(11, 0.3 * STALL_FACTOR * 0.99)])  # a slow step, short of a stall, counts whole
    assert tally.productive_s == pytest.approx(3.3 + 0.3 * STALL_FACTOR * 0.99)
