"""A worker node cut off by the network, on a real multi-node Ray cluster in network namespaces.

The cluster (`elastic.testing.NetworkCluster`) is a head with no CPUs for workers and three
worker nodes of one CPU each, so each worker has a node, and a link, of its own. The driver runs
in the head's namespace; the test takes a worker node's link down, which sends its peers no
reset: they block in the all-reduce on it, as behind a pulled cable or a rebooting switch.

Each run must end completed, every sample consumed exactly once, with parameters equal to a
fault-free run within 1e-9 (float64), with only the cut-off worker failed (as unreachable)
and every survivor in the process it started in; a run whose survivors were blamed, or that
restarted, or that counted anything the cut-off worker did, fails one of those.

    pytest tests/test_partitions.py
"""

import json
import re
import time
from pathlib import Path

import pytest
import torch

from elastic.events import read_events
from elastic.storage import RunStorage
from elastic.testing import NetworkCluster
from workloads import STEPS_PER_EPOCH

UNAVAILABLE = NetworkCluster.unavailable()
pytestmark = [pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no network namespaces: {UNAVAILABLE}"),
              pytest.mark.timeout(600)]

DRIVER = Path(__file__).with_name("network_driver.py")
PARAM_TOLERANCE = 1e-9
MAX_STEPS = 30 * STEPS_PER_EPOCH
STEP_COMPUTE_S = 0.05  # the 50 ms steps: a sleep inside each step
CUT_AT_STEP = 20  # training is held here until every worker started, then cut a moment later
RUN_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def cluster():
    with NetworkCluster(nodes=4, cpus_per_node=1, head_cpus=0) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("partition-reference")
    driver = _spawn(cluster, folder, "reference", (2, 2))
    return _result(driver, folder, "reference")


def _spawn(cluster, folder, name, workers, gate=None, failure=None):
    loop = {"max_steps": MAX_STEPS, "compute_s": STEP_COMPUTE_S, "sleep_s": 0.0}
    if gate:
        loop["gate"] = (CUT_AT_STEP, str(gate))
    run = {"name": name, "storage_path": str(folder), "workers": list(workers), "loop": loop,
           "failure": failure or {}, "out": str(folder / f"{name}.pt")}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(run))
    log = open(folder / f"{name}.log", "w")
    return cluster.spawn_driver(DRIVER, [str(path)], stdout=log, stderr=log)


def _result(driver, folder, name):
    driver.wait(RUN_TIMEOUT_S)
    assert driver.returncode == 0, f"the driver failed: {(folder / f'{name}.log').read_text()[-3000:]}"
    return torch.load(folder / f"{name}.pt", weights_only=True)


def _events(folder, name):
    return read_events(RunStorage(str(folder), name))


def _wait_for(folder, name, condition, driver, timeout_s=RUN_TIMEOUT_S):
    deadline = time.time() + timeout_s
    while time.time() < deadline and driver.poll() is None:
        found = condition(_events(folder, name))
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{name}: the run never got there: {(folder / f'{name}.log').read_text()[-3000:]}")


def _node_of(event, cluster) -> int:
    """The cluster node a worker started on, from the address it bound (`worker_started.binds`)."""
    address = re.search(r"\((198\.\d+\.\d+\.\d+)", event["binds"]).group(1)
    return next(node for node in range(cluster.nodes) if cluster.node_ip(node) == address)


def _assert_same_training(outcome, reference):
    assert outcome["step"] == MAX_STEPS
    ledger = outcome["ledger"]
    assert torch.equal(ledger, torch.ones_like(ledger)), "a sample was lost or seen twice"
    for key, value in reference["params"].items():
        difference = (outcome["params"][key] - value).abs().max().item()
        assert difference < PARAM_TOLERANCE, f"{key} differs by {difference}"


def test_a_worker_node_cut_off_mid_step_is_healed_around_and_no_survivor_is_blamed(cluster, reference, tmp_path):
    name = "cut"
    gate = tmp_path / "every-worker-started"
    driver = _spawn(cluster, tmp_path, name, (2, 3), gate=gate)
    _wait_for(tmp_path, name, lambda events: len([e for e in events if e["type"] == "worker_started"]) >= 3, driver)
    gate.touch()
    first = _wait_for(tmp_path, name, lambda events: [e for e in events if e["type"] == "generation_formed"
                                                      and e["world_size"] == 3][-1:], driver)[0]
    started = [e for e in _events(tmp_path, name) if e["type"] == "worker_started"]
    victim = first["members"][2]
    node = _node_of(next(e for e in started if e["worker_id"] == victim["worker_id"]), cluster)
    time.sleep(0.4)  # a few steps on: the cut lands inside one, while its peers wait in the all-reduce
    cluster.partition(node)
    heal = _wait_for(tmp_path, name, lambda events: [e for e in events if e["type"] == "recovery"], driver)[0]
    cluster.heal(node)  # the link comes back: the old worker must not come back with it
    outcome = _result(driver, tmp_path, name)

    _assert_same_training(outcome, reference)
    events = _events(tmp_path, name)
    failed = [e for e in events if e["type"] == "worker_failed"]
    assert [(e["worker_id"], e["kind"]) for e in failed] == [(victim["worker_id"], "unreachable")], failed
    formed = [e for e in events if e["type"] == "generation_formed"]
    healed = next(e for e in formed if e["time"] >= failed[0]["time"])
    assert healed["kind"] == "heal", "a heal in place, not a restart"
    survivors = {m["worker_id"]: m["pid"] for m in first["members"] if m["worker_id"] != victim["worker_id"]}
    assert {m["worker_id"]: m["pid"] for m in healed["members"]} == survivors, "a survivor changed or left"
    assert not [e for e in events if e["type"] == "recovery" and e["from_checkpoint"]]
    assert heal["detect_s"] > 0 and heal["seconds"] >= heal["detect_s"], "the recovery hides the standstill"
