"""The goodput benchmark's arithmetic (benchmarks/goodput.py): what a run committed, from its stamps."""

from benchmarks.goodput import summarise


def _stamp(step, t, samples=128, **extra):
    return {"step": step, "t": t, "samples": samples, "pid": 1, **extra}


def test_a_restore_from_a_checkpoint_counts_each_redone_step_once_and_the_undone_attempts_not_at_all():
    # Steps 0-5 commit, a death at t=6.5 loses steps 4-5 (the checkpoint holds 0-3), and they are redone.
    stamps = [_stamp(s, float(s)) for s in range(6)] + [_stamp(4, 10.0, 96), _stamp(5, 11.0), _stamp(6, 12.0)]
    outcome = summarise(stamps, [{"t": 6.5, "pid": 7}], first=0.0, end=20.0)
    assert outcome["committed_steps"] == 7
    assert outcome["samples_per_s"] == (6 * 128 + 96) / 20.0
    assert outcome["steps_once"]
    (death,) = outcome["deaths"]
    assert death["recovery_s"] == 10.0 - 6.5 and death["steps_lost"] == 2


def test_a_heal_in_place_loses_no_step_and_its_recovery_runs_to_the_next_commit():
    stamps = [_stamp(s, float(s), probe=2.0 - s / 10) for s in range(4)] + [_stamp(4, 4.8)]
    outcome = summarise(stamps, [{"t": 3.5, "pid": 7}], first=0.0, end=5.0)
    (death,) = outcome["deaths"]
    assert death["steps_lost"] == 0 and abs(death["recovery_s"] - 1.3) < 1e-9
    assert outcome["probes"] == {0: 2.0, 1: 1.9, 2: 1.8, 3: 1.7}
    assert [n for _, n in outcome["timeline"]] == [1, 2, 3, 4, 5]


def test_a_death_with_no_commit_after_it_has_no_recovery_time():
    outcome = summarise([_stamp(0, 0.0)], [{"t": 0.5, "pid": 7}], first=0.0, end=1.0)
    assert outcome["deaths"] == [{"t": 0.5, "recovery_s": None, "steps_lost": None}]
