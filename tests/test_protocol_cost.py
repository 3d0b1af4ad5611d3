"""A formation costs the controller O(W) at W workers: counted, never timed.

The fake worker group runs the same start, heal and grow at 1,000 and at 4,000 workers while a
counter tallies each time the protocol touches a worker: every read of a field of a worker's
record, and every hash or comparison of a worker id that an observation carries (a dict or a
set keyed by workers, a membership test, a sort or a copy of the acknowledgements so far each
hash or compare them). Four times the workers must cost about four times the touches. A copy of
the acknowledgements at each acknowledgement, or a look at every worker at each ready worker,
costs sixteen times.
"""

import contextlib

import pytest

from elastic.controller.fake_group import FakeWorkerGroup
from elastic.controller.protocol import WorkerRecord
from elastic.controller.signals import Exit, FormedReport, SwitchPrepared, WorkerExited, WorkerReady

pytestmark = pytest.mark.timeout(120)

SMALL, LARGE = 1000, 4000
# Linear is 4.0 plus what does not grow with W; O(W^2) is 16, O(W log W) sorts 4.8.
MOST_GROWTH = 1.2 * LARGE / SMALL


class Touches:
    count = 0


class CountedId(int):
    """A worker id that counts each hash and comparison of itself."""

    def __hash__(self):
        Touches.count += 1
        return int.__hash__(self)

    def __eq__(self, other):
        Touches.count += 1
        return int.__eq__(self, other)

    def __ne__(self, other):
        Touches.count += 1
        return int.__ne__(self, other)

    def __lt__(self, other):
        Touches.count += 1
        return int.__lt__(self, other)


def _counting_getattribute(record, name):
    Touches.count += 1
    return object.__getattribute__(record, name)


@contextlib.contextmanager
def counted(touches, event):
    """Add the touches of what runs inside to `touches[event]`."""
    before = Touches.count
    yield
    touches[event] = touches.get(event, 0) + Touches.count - before


def formed(group, step=0):
    offer = group.latest_offer.formation
    return [FormedReport(CountedId(w), offer.generation, ok=True, step=step, timings={"sync_s": 0.01})
            for w in offer.members]


def touches_of_formations(size):
    """The touches of a start, a heal and a grow at `size` workers."""
    group = FakeWorkerGroup(min_workers=size // 2, max_workers=size)
    touches = {}
    readies = [WorkerReady(CountedId(w), node=f"node-{w}", pid=w) for w in range(size)]
    with counted(touches, "start"):
        group.deliver(readies, after_s=1e-4)
    with counted(touches, "start"):
        group.deliver(formed(group))
    assert len(group.protocol.members) == size

    group.commit_step(1)
    with counted(touches, "heal"):
        group.send(WorkerExited(CountedId(1), Exit.DIED, "died"))
    with counted(touches, "heal"):
        group.deliver(formed(group, step=1))
    assert len(group.protocol.members) == size - 1

    group.commit_step(2)
    newcomer = group.started[-1]
    with counted(touches, "grow"):
        group.send(WorkerReady(CountedId(newcomer), node="node-new", pid=newcomer))
    prepare = max(group.prepares)
    answers = [SwitchPrepared(CountedId(w), prepare, 2) for w in group.protocol.members]
    with counted(touches, "grow"):
        group.deliver(answers)
    with counted(touches, "grow"):
        group.deliver(formed(group, step=2))
    assert len(group.protocol.members) == size and group.state == "RUNNING"
    return touches


def test_a_formation_costs_the_controller_linear_in_the_world_size(monkeypatch):
    monkeypatch.setattr(WorkerRecord, "__getattribute__", _counting_getattribute)
    small, large = touches_of_formations(SMALL), touches_of_formations(LARGE)
    growth = {event: large[event] / small[event] for event in small}
    assert all(small.values()), f"the counter saw nothing: {small}"
    assert max(growth.values()) <= MOST_GROWTH, (
        f"{LARGE // SMALL} times the workers cost {growth} times the touches (at {SMALL}: {small}; at "
        f"{LARGE}: {large}); linear is {LARGE // SMALL}")
