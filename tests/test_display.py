"""The driver's progress display: sparse plain lines in a job log, one redrawn line on a terminal."""

import io

import pytest

from elastic.journal.display import PLAIN_LINE_INTERVAL_S, ProgressDisplay, plain_line

pytestmark = pytest.mark.timeout(30)


def status(**changes):
    """A status dict shaped like Controller.status()."""
    base = {"state": "RUNNING", "step": 10, "max_steps": 300, "samples_per_s": 123.4, "productive_s": 5.0,
            "metrics": {"step": 9, "loss": 2.34567}, "world_size": 3, "generation": 0, "last_event": "metrics"}
    return {**base, **changes}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def log():
    stream, clock = io.StringIO(), FakeClock()
    return stream, clock, ProgressDisplay(stream, clock=clock)


def test_a_job_log_gets_the_first_status_at_once_as_a_plain_line(log):
    stream, _, display = log

    display.show(status())

    assert not display.live
    assert stream.getvalue() == ("[elastic] RUNNING        step 10/300  world 3  123 samples/s  loss 2.3457  "
                                 "last: metrics\n")


def test_a_job_log_gets_at_most_one_line_per_interval_while_nothing_changes(log):
    stream, clock, display = log

    for step in range(10, 30):
        display.show(status(step=step))
        clock.now += PLAIN_LINE_INTERVAL_S / 4
    lines = stream.getvalue().splitlines()

    assert [line.split()[3] for line in lines] == ["10/300", "14/300", "18/300", "22/300", "26/300"]


def test_a_job_log_gets_a_line_at_once_when_the_state_or_world_size_changes(log):
    stream, clock, display = log

    display.show(status(step=10))
    clock.now += 0.5
    display.show(status(step=11, state="RECONFIGURING", last_event="worker_failed"))
    clock.now += 0.5
    display.show(status(step=11, world_size=2, last_event="generation_formed"))
    clock.now += 0.5
    display.show(status(step=12, world_size=2))  # nothing changed: waits for the interval
    lines = stream.getvalue().splitlines()

    assert len(lines) == 3
    assert "RECONFIGURING" in lines[1] and "last: worker_failed" in lines[1]
    assert "world 2" in lines[2] and "RUNNING" in lines[2]


def test_closing_a_job_log_writes_the_last_status_it_held_back(log):
    stream, clock, display = log
    display.show(status(step=10))
    clock.now += 1
    display.show(status(step=299))

    display.close()

    assert stream.getvalue().splitlines()[-1].split()[3] == "299/300"
    display.close()
    assert len(stream.getvalue().splitlines()) == 2


def test_a_plain_line_leaves_out_the_loss_when_none_was_reported():
    line = plain_line(status(metrics={}, last_event=""))

    assert line == "[elastic] RUNNING        step 10/300  world 3  123 samples/s"


def test_a_terminal_gets_one_line_redrawn_in_place(monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    stream = Terminal()
    display = ProgressDisplay(stream)

    display.show(status(step=10))
    display.show(status(step=150, world_size=2))
    before_close = stream.getvalue()
    display.close()

    assert display.live
    assert "\n" not in before_close  # redrawn with carriage returns, never a new line
    assert "step 150/300  world 2  123 samples/s  loss 2.3457  last: metrics" in before_close
    assert stream.getvalue().endswith("\n\x1b[?25h")  # the final line stays, and the cursor comes back


def test_a_narrow_terminal_cuts_the_line_instead_of_wrapping_it(monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")
    stream = Terminal()
    display = ProgressDisplay(stream)

    display.show(status())
    display.close()

    assert stream.getvalue().count("\n") == 1
    assert "…" in stream.getvalue()
