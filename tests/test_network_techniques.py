"""Every family of techniques heals in place through an outside SIGKILL on links shaped to
1 Gbit/s, on a real multi-node Ray cluster in network namespaces (a head with no CPUs for
workers and three worker nodes of one CPU each, every link through `tc tbf`).

One run per family: compression (PowerSGD, whose state is per rank, and bf16 buckets), local
updates (DiLoCo), sharding (ZeRO-3 on FSDP2), mixed precision (bf16 autocast) and the optimizer
stepped bucket by bucket as the all-reduces land (`overlap_optimizer`). Each trains 3
workers (min 2) of a 4096-wide MLP, whose 590 KB of float64 gradients cross the shaped links each step, and rank 2's
process is SIGKILLed from outside inside a step. Each run must end completed, every sample
consumed exactly once, with only the killed worker failed, the survivors healed in place in the
processes they started in (no restart from a checkpoint), and a finite loss.

    pytest -m soak tests/test_network_techniques.py      # about 3 minutes and a half
"""

import os
import signal
import time

import pytest
import torch

from elastic.testing import NetworkCluster
from network_driver import HEAVY, events, result, start_full

UNAVAILABLE = NetworkCluster.unavailable()
pytestmark = [pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no network namespaces: {UNAVAILABLE}"),
              pytest.mark.timeout(600), pytest.mark.soak]

FAMILIES = {
    "compression-powersgd": ({"compression": "powersgd:rank=2,start_iter=2"}, {}),
    "compression-bf16": ({"compression": "bf16"}, {}),
    "local-updates-diloco": ({"sync": "diloco:every=8"}, {}),
    "sharding-zero3": ({"zero": 3}, {"optimizer": "adamw"}),
    "precision-bf16": ({"precision": "bf16"}, {"dtype": "float32"}),
    "overlapped-optimizer": ({"overlap_optimizer": True}, {"optimizer": "adamw"}),
}


@pytest.fixture(scope="module")
def cluster():
    with NetworkCluster(nodes=4, cpus_per_node=1, head_cpus=0, rate="1gbit") as cluster:
        yield cluster


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_technique_heals_in_place_through_an_outside_sigkill_on_a_1gbit_network(cluster, tmp_path, family):
    strategy, loop_config = FAMILIES[family]
    driver, first, _ = start_full(cluster, tmp_path, family, HEAVY, strategy=strategy, loop_config=loop_config)
    time.sleep(HEAVY.cut_after_s)
    victim = first["members"][2]
    os.kill(victim["pid"], signal.SIGKILL)  # the namespaces share this machine's pids
    outcome = result(driver, tmp_path, family)
    found = events(tmp_path, family)

    assert outcome["step"] == HEAVY.max_steps
    ledger = outcome["ledger"]
    assert torch.equal(ledger, torch.ones_like(ledger)), "a sample was lost or seen twice"
    assert all(torch.isfinite(value).all() for value in outcome["params"].values())
    failed = [e for e in found if e["type"] == "worker_failed"]
    assert [e["worker_id"] for e in failed] == [victim["worker_id"]], failed
    healed = next(e for e in found if e["type"] == "generation_formed" and e["time"] >= failed[0]["time"])
    assert healed["kind"] == "heal", "a heal in place, not a restart"
    survivors = {m["worker_id"]: m["pid"] for m in first["members"] if m["worker_id"] != victim["worker_id"]}
    assert {m["worker_id"]: m["pid"] for m in healed["members"]} == survivors, "a survivor changed or left"
    [recovery] = [e for e in found if e["type"] == "recovery"]
    assert not recovery["from_checkpoint"]
