"""A worker node cut off by the network, on a real multi-node Ray cluster in network namespaces.

The cluster (`elastic.testing.NetworkCluster`) is a head with no CPUs for workers and three
worker nodes of one CPU each, so each worker has a node, and a link, of its own. Each node's
hostname resolves to 127.0.0.1, as on this machine (Debian and Ubuntu images map it to
127.0.1.1): gloo, left to the hostname, would listen on loopback and no generation across nodes
would connect. The driver runs in the head's namespace (tests/network_driver.py); the test takes
a worker node's link down, which sends its peers no reset: they block in the all-reduce on it,
as behind a pulled cable or a rebooting switch.

Each run must end completed, every sample consumed exactly once, with parameters equal within
1e-9 (float64) to one process training each step's whole global batch, with only the cut-off
worker failed (as unreachable: besides a worker the test kills itself) and every survivor in the
process it started in; a run whose survivors were blamed, or that restarted, or that counted
anything the cut-off worker did, fails one of those.

    pytest tests/test_partitions.py              # in CI: the cut at 50 ms steps, the binding
    pytest -m soak tests/test_partitions.py      # plus: the cut at 1 s steps and at 2 workers, and under
        # stale synchrony at 50 ms and 1 s steps; a cut
        # while checkpoints are written, while a heal forms, while a grow forms, and a link back
        # after 30 s and 60 s, each at 50 ms and 1 s steps; a flapping link; a slow link
        # (3 Mbit/s), and a node on a 100 Mbit/s link with and without straggler_factor
"""

import dataclasses
import os
import signal
import subprocess
import time

import pytest
import torch

from elastic.checkpoint.checkpoint import Checkpoint, checkpoint_steps, checkpoint_storage, step_dir, verify
from elastic.checkpoint.storage import RunStorage
from elastic.testing import NetworkCluster
from network_driver import (DATA_SEED, FAST, GROWING, HEAVY, MEASURED, SLOW, WIDE, cut_mid_step, cut_partially, events,
                            node_of, result, start_full, wait_for)
from workloads import STEPS_PER_EPOCH, regression_reference

UNAVAILABLE = NetworkCluster.unavailable()
pytestmark = [pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no network namespaces: {UNAVAILABLE}"),
              pytest.mark.timeout(600)]

PARAM_TOLERANCE = 1e-9
# CI's cut at 50 ms steps: FAST's steps, 12 epochs rather than 30. The cut lands within the first
# generation's first second, and the heal around it within two more; the rest is steady training.
CI_FAST = dataclasses.replace(FAST, max_steps=12 * STEPS_PER_EPOCH)
# CI's partial cut at 0.3 s steps: four epochs rather than five (the cut lands a second in).
CI_MEASURED = dataclasses.replace(MEASURED, max_steps=4 * STEPS_PER_EPOCH)


@pytest.fixture(scope="module")
def cluster():
    with NetworkCluster(nodes=4, cpus_per_node=1, head_cpus=0, hosts_loopback=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cuts(cluster, tmp_path_factory):
    """`cut_mid_step` at a pace and a number of workers, run once for every test that reads it."""
    runs = {}

    def cut(pace, workers):
        if (pace, workers) not in runs:
            runs[pace, workers] = cut_mid_step(cluster, tmp_path_factory.mktemp("cut"), pace, workers=workers)
        return runs[pace, workers]

    return cut


def _assert_same_training(outcome, pace, stale=None):
    """Completed, exactly once, and the math of one process on each whole global batch (each
    applied `stale` steps late under `Strategy(sync="stale:bound=S")`)."""
    reference = regression_reference(pace.max_steps, seed=DATA_SEED, hidden=pace.hidden, lr=pace.lr, stale=stale)
    assert outcome["step"] == pace.max_steps
    ledger = outcome["ledger"]
    assert torch.equal(ledger, torch.ones_like(ledger)), "a sample was lost or seen twice"
    for key, value in reference["params"].items():
        difference = (outcome["params"][key] - value).abs().max().item()
        assert difference < PARAM_TOLERANCE, f"{key} differs by {difference}"


def _assert_healed_around_the_victim_only(cut, kind):
    """Only the cut-off worker failed (as `kind`), the survivors healed in place in their own
    processes, and the recovery counts the standstill before the heal."""
    failed = [e for e in cut.events if e["type"] == "worker_failed"]
    assert [(e["worker_id"], e["kind"]) for e in failed] == [(cut.victim["worker_id"], kind)], failed
    healed = next(e for e in cut.events if e["type"] == "generation_formed" and e["time"] >= failed[0]["time"])
    assert healed["kind"] == "heal", "a heal in place, not a restart"
    survivors = {m["worker_id"]: m["pid"] for m in cut.first["members"] if m["worker_id"] != cut.victim["worker_id"]}
    assert {m["worker_id"]: m["pid"] for m in healed["members"]} == survivors, "a survivor changed or left"
    [recovery] = [e for e in cut.events if e["type"] == "recovery"]
    assert not recovery["from_checkpoint"]
    assert recovery["detect_s"] > 0 and recovery["seconds"] >= recovery["detect_s"], "the recovery hides the standstill"


@pytest.mark.parametrize(("pace", "workers"), [(CI_FAST, 3), pytest.param(SLOW, 3, marks=pytest.mark.soak),
                                               pytest.param(FAST, 2, marks=pytest.mark.soak),
                                               pytest.param(SLOW, 2, marks=pytest.mark.soak)],
                         ids=["50ms-3-workers", "1s-3-workers", "50ms-2-workers", "1s-2-workers"])
def test_a_worker_node_cut_off_mid_step_is_healed_around_and_no_survivor_is_blamed(cuts, pace, workers):
    cut = cuts(pace, workers)
    _assert_same_training(cut.outcome, pace)
    _assert_healed_around_the_victim_only(cut, "unreachable")


@pytest.mark.parametrize("pace", [CI_MEASURED, pytest.param(SLOW, marks=pytest.mark.soak)], ids=["300ms", "1s"])
def test_a_worker_cut_off_from_its_peers_but_not_the_controller_is_healed_around_and_the_waiters_are_not_blamed(
        cluster, tmp_path, pace):
    # Every rank answers the controller and waits in the all-reduce: nothing is dead or behind. The
    # kernel's word on the links (data sent to rank 1, and by it, unacknowledged) names the cut.
    cut = cut_partially(cluster, tmp_path, pace)
    _assert_same_training(cut.outcome, pace)
    _assert_healed_around_the_victim_only(cut, "cut_off")


@pytest.mark.soak
@pytest.mark.parametrize("pace", [FAST, SLOW], ids=["50ms", "1s"])
def test_stale_synchrony_heals_a_worker_node_cut_off_mid_step_exactly(cluster, tmp_path, pace):
    # The survivors block on reductions the cut node never joins; the heal rolls them back to
    # the complete state S steps behind, and the run still ends as if nothing had happened. At
    # the paces' lr 0.05 with momentum 0.9, gradients two steps late diverge within 240 steps
    # (the reference's loss reaches 1e30), so these runs take lr 0.01.
    pace = dataclasses.replace(pace, lr=0.01)
    cut = cut_mid_step(cluster, tmp_path, pace, name="stale-cut", strategy={"sync": "stale:bound=2"})
    _assert_same_training(cut.outcome, pace, stale=2)
    failed = [e for e in cut.events if e["type"] == "worker_failed"]
    assert [(e["worker_id"], e["kind"]) for e in failed] == [(cut.victim["worker_id"], "unreachable")], failed
    [recovery] = [e for e in cut.events if e["type"] == "recovery"]
    assert not recovery["from_checkpoint"] and recovery["steps_lost"] >= 2, recovery


@pytest.mark.soak
@pytest.mark.parametrize("pace", [FAST, SLOW], ids=["50ms", "1s"])
def test_the_overlapped_optimizer_heals_a_worker_node_cut_off_mid_step_exactly(cluster, tmp_path, pace):
    # The survivors' buckets that landed before the cut have stepped; the heal puts them back and
    # redoes the step, so the run ends as DDP's.
    cut = cut_mid_step(cluster, tmp_path, pace, name="overlap-cut", strategy={"overlap_optimizer": True})
    _assert_same_training(cut.outcome, pace)
    failed = [e for e in cut.events if e["type"] == "worker_failed"]
    assert [(e["worker_id"], e["kind"]) for e in failed] == [(cut.victim["worker_id"], "unreachable")], failed


def test_the_groups_bind_each_nodes_own_address_where_the_hostname_resolves_to_loopback(cluster, cuts):
    # The cut run trained across the three worker nodes (its first generation of 3; the victim's
    # replacement came later); each worker says what its groups bound.
    cut = cuts(CI_FAST, 3)
    started = {e["worker_id"]: e for e in cut.events if e["type"] == "worker_started"}
    first = [started[m["worker_id"]] for m in cut.first["members"]]
    assert sorted(node_of(e, cluster) for e in first) == [1, 2, 3], first
    assert all("the Ray node's address" in e["binds"] for e in started.values()), [e["binds"] for e in started.values()]


@pytest.mark.soak
def test_a_flapping_link_never_fails_the_run_and_nothing_is_lost(cluster, tmp_path):
    driver, _, node = start_full(cluster, tmp_path, "flap", FAST)
    cluster.flap(node, down_s=2.0, up_s=2.0, times=4).join()
    _assert_same_training(result(driver, tmp_path, "flap"), FAST)
    failed = [e for e in events(tmp_path, "flap") if e["type"] == "worker_failed"]
    assert all(e["kind"] == "unreachable" for e in failed), f"a reachable worker was blamed: {failed}"


@pytest.mark.soak
def test_a_slow_link_slows_the_run_and_kills_nothing(cluster, tmp_path):
    # 3 Mbit/s carries a step's 74 KB gradient all-reduce (twice that on the wire) in about 0.4 s,
    # eight times the step's compute: the run goes at the slow node's pace, and it is not evicted.
    driver, _, node = start_full(cluster, tmp_path, "slow-link", WIDE)
    cluster.shape(node, "3mbit")
    try:
        outcome = result(driver, tmp_path, "slow-link")
    finally:
        cluster.shape(node, None)
    _assert_same_training(outcome, WIDE)
    assert not [e for e in events(tmp_path, "slow-link") if e["type"] == "worker_failed"], "a slow node was evicted"


@pytest.mark.soak
@pytest.mark.parametrize("factor", [None, 3.0], ids=["without-straggler-factor", "straggler-factor-3"])
def test_a_node_on_a_100mbit_link_is_evicted_as_a_network_straggler_only_when_asked(cluster, tmp_path, factor):
    # The last rank's node is shaped to 100 Mbit/s both ways once every worker trains; the
    # others' links stay unshaped (about 18 Gbit/s here). Its compute is the others'.
    name = "slow-node" if factor else "slow-node-tolerated"
    failure = {"straggler_factor": factor, "straggler_steps": 10} if factor else {}
    driver, first, node = start_full(cluster, tmp_path, name, HEAVY, failure=failure)
    cluster.shape(node, "100mbit")
    try:
        outcome = result(driver, tmp_path, name)
    finally:
        cluster.shape(node, None)
    _assert_same_training(outcome, HEAVY)
    found = events(tmp_path, name)
    failed = [e for e in found if e["type"] == "worker_failed"]
    if factor is None:
        assert not failed, f"a slow link evicted a worker without straggler_factor: {failed}"
        return
    assert failed, "the node on the slow link was never evicted"
    victim = first["members"][-1]["worker_id"]
    assert (failed[0]["worker_id"], failed[0]["kind"]) == (victim, "straggler"), failed[0]
    assert failed[0]["cause"].startswith("the network") and cluster.node_ip(node) in failed[0]["cause"], failed[0]
    started = {e["worker_id"]: e for e in found if e["type"] == "worker_started"}
    assert all(node_of(started[e["worker_id"]], cluster) == node for e in failed), "a worker off the slow node was evicted"


REJOIN_HOLD_STEP = 120  # the survivors wait here, at 2, until the cut-off node's fate is known


def _raylet_runs_in(cluster, node: int) -> bool:
    pids = subprocess.run(["ip", "netns", "pids", cluster.namespace(node)], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            if "raylet" in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
                return True
        except OSError:
            continue  # ended meanwhile
    return False


@pytest.mark.soak
@pytest.mark.parametrize(("back_after_s", "pace"), [(30.0, FAST), (60.0, FAST), (30.0, SLOW), (60.0, SLOW)],
                         ids=["30s-50ms", "60s-50ms", "30s-1s", "60s-1s"])
def test_a_node_back_later_never_resurrects_its_worker(cluster, tmp_path, back_after_s, pace):
    # Either the node is still in Ray's cluster when its link is back: the worker's kill is
    # delivered, and a replacement takes the CPU it held (none is free elsewhere). Or Ray has
    # declared the node dead, and its raylet ends, with the worker, as it hears so: the run
    # finishes at 2. Either way the old worker never trains again. Which one is Ray's doing: back
    # after 30 s at 50 ms steps the node lived; at 1 s steps its raylet had ended (twice here,
    # the cause not found); back after 60 s it had ended (5 missed health checks).
    name = f"back-{back_after_s:.0f}s"
    hold = tmp_path / f"{name}-fate-known"
    driver, first, node = start_full(cluster, tmp_path, name, pace, hold=(min(REJOIN_HOLD_STEP, pace.max_steps // 2), hold))
    victim = first["members"][-1]["worker_id"]
    time.sleep(pace.cut_after_s)
    cut_at = time.time()
    cluster.partition(node)
    wait_for(tmp_path, name, lambda found: [e for e in found if e["type"] == "recovery"], driver)
    time.sleep(max(0.0, cut_at + back_after_s - time.time()))
    cluster.heal(node)
    wait_for(tmp_path, name, lambda found: not _raylet_runs_in(cluster, node)
             or len([e for e in found if e["type"] == "worker_started"]) >= 4, driver)
    hold.touch()
    outcome = result(driver, tmp_path, name)
    node_lived = _raylet_runs_in(cluster, node)
    if not node_lived:
        cluster.restart(node)  # the module's other tests use every node
    _assert_same_training(outcome, pace)
    found = events(tmp_path, name)
    failed = [e for e in found if e["type"] == "worker_failed"]
    assert [(e["worker_id"], e["kind"]) for e in failed] == [(victim, "unreachable")], failed
    later = [e for e in found if e["type"] == "generation_formed" and e["time"] > cut_at]
    assert all(victim not in [m["worker_id"] for m in e["members"]] for e in later), "the cut-off worker came back"
    started = {e["worker_id"]: e for e in found if e["type"] == "worker_started"}
    replacements = [w for w in started if w not in [m["worker_id"] for m in first["members"]]]
    if node_lived:
        [replacement] = replacements
        assert node_of(started[replacement], cluster) == node, "the replacement did not take the freed node"
        assert later[-1]["world_size"] == 3 and replacement in [m["worker_id"] for m in later[-1]["members"]]
    else:
        assert replacements == [] and later[-1]["world_size"] == 2


@pytest.mark.soak
@pytest.mark.parametrize("pace", [GROWING, FAST], ids=["1s", "50ms"])
def test_a_member_cut_off_while_a_grow_forms_is_left_behind_and_the_grow_completes_without_it(cluster, tmp_path, pace):
    # A SIGKILL takes the last rank; its replacement starts on the freed node, and while the
    # grow that takes it in prepares and forms, the node of another survivor is cut off. At 1 s
    # steps that is a step or more; at 50 ms steps the grow takes a few steps' time, and the cut
    # lands inside it or just after it committed (the grown generation then heals without it).
    driver, first, _ = start_full(cluster, tmp_path, "grow-cut", pace)
    members = first["members"]
    started = {e["worker_id"]: e for e in events(tmp_path, "grow-cut") if e["type"] == "worker_started"}
    killed, cut = members[-1]["worker_id"], members[1]["worker_id"]
    os.kill(started[killed]["pid"], signal.SIGKILL)
    grow = wait_for(tmp_path, "grow-cut", lambda found: [
        e for e in found if e["type"] == "state" and e["state"] in ("PREPARING", "FORMING")
        and e["time"] > max(s["time"] for s in found if s["type"] == "worker_started")
        and len([s for s in found if s["type"] == "worker_started"]) > 3], driver)[0]
    _partition_until_lost(cluster, tmp_path, "grow-cut", driver, node_of(started[cut], cluster), cut)
    found = _killed_and_cut_only(driver, tmp_path, "grow-cut", pace, killed, cut, members[0])
    after = [e for e in found if e["type"] == "generation_formed" and e["time"] > grow["time"]]
    assert after and all(cut not in [m["worker_id"] for m in e["members"]] for e in after[1:])


def _partition_until_lost(cluster, folder, name, driver, node: int, worker_id: int) -> None:
    """Cut node `node` off until the controller gave up on worker `worker_id`, then heal the link."""
    cluster.partition(node)
    try:
        wait_for(folder, name, lambda found: [e for e in found if e["type"] == "worker_failed"
                                              and e["worker_id"] == worker_id], driver)
    finally:
        cluster.heal(node)


def _killed_and_cut_only(driver, folder, name, pace, killed: int, cut: int, survivor: dict) -> list[dict]:
    """The run's events, once it ended trained as one process would, with only the SIGKILLed
    worker failed (a death) and the cut-off one (unreachable), `survivor` in its own process in
    every generation, and no restart."""
    _assert_same_training(result(driver, folder, name), pace)
    found = events(folder, name)
    failed = [(e["worker_id"], e["kind"]) for e in found if e["type"] == "worker_failed"]
    assert failed == [(killed, "death"), (cut, "unreachable")], failed
    formed = [e for e in found if e["type"] == "generation_formed"]
    assert all(m["pid"] == survivor["pid"] for e in formed for m in e["members"] if m["worker_id"] == survivor["worker_id"])
    assert not [e for e in found if e["type"] == "recovery" and e["from_checkpoint"]], "a heal became a restart"
    return found


@pytest.mark.soak
@pytest.mark.parametrize("pace", [FAST, SLOW], ids=["50ms", "1s"])
def test_a_worker_cut_off_while_it_writes_checkpoints_adds_nothing_a_resume_reads(cluster, tmp_path, pace):
    # A checkpoint every step: at the cut the victim's writer is writing, or reporting, the
    # shard of the step before, to storage it can still reach (this machine's disk). Its report
    # reaches the controller only once the link is back, and is refused; its files lie in its
    # own generation's folder of the step, which no later manifest lists.
    cut = cut_mid_step(cluster, tmp_path, pace, name="cut-writing", checkpoint_every=1)
    _assert_same_training(cut.outcome, pace)
    failed = [(e["worker_id"], e["kind"]) for e in cut.events if e["type"] == "worker_failed"]
    assert failed == [(cut.victim["worker_id"], "unreachable")], failed
    fenced = [e for e in cut.events if e["type"] == "fenced"]
    assert all(e["worker_id"] == cut.victim["worker_id"] for e in fenced), fenced
    run = RunStorage(str(tmp_path), "cut-writing")
    later = {e["generation"] for e in cut.events if e["type"] == "generation_formed" and e["time"] > cut.cut_at}
    complete = [s for s in checkpoint_steps(run) if run.size(f"{step_dir(s)}/manifest.json") is not None]
    assert complete, "no checkpoint was kept"
    for step in complete:
        checkpoint = verify(checkpoint_storage(run, step))
        paths = {entry["path"].split("/")[0] for entry in checkpoint.manifest["files"]}  # gen-<G>-<attempt>
        assert {int(path.split("-")[1]) for path in paths} <= later, (
            f"step {step} lists files of {paths}, not of a generation after the cut")
    final = Checkpoint.from_path(run.path(step_dir(max(complete)))).load_state()["model"]
    assert all(torch.equal(final[k], v) for k, v in cut.outcome["params"].items()), "the last checkpoint is not the run's end"


@pytest.mark.soak
@pytest.mark.parametrize("pace", [FAST, SLOW], ids=["50ms", "1s"])
def test_a_member_cut_off_while_the_heal_of_a_death_forms_is_lost_too_and_the_survivor_carries_on(cluster, tmp_path,
                                                                                                  pace):
    # A SIGKILL takes the last rank; 20 ms later, as the survivors' heal forms, the middle
    # rank's node is cut off. The heal cannot complete with it: it is unreachable, lost in turn,
    # and rank 0 waits at 1 (below min_workers, 2) until the dead worker's replacement joins.
    driver, first, _ = start_full(cluster, tmp_path, "heal-cut", pace)
    members = first["members"]
    started = {e["worker_id"]: e for e in events(tmp_path, "heal-cut") if e["type"] == "worker_started"}
    killed, cut = members[-1]["worker_id"], members[1]["worker_id"]
    cut_node = node_of(started[cut], cluster)
    time.sleep(pace.cut_after_s)
    os.kill(started[killed]["pid"], signal.SIGKILL)
    time.sleep(0.02)
    _partition_until_lost(cluster, tmp_path, "heal-cut", driver, cut_node, cut)
    found = _killed_and_cut_only(driver, tmp_path, "heal-cut", pace, killed, cut, members[0])
    formed = [e for e in found if e["type"] == "generation_formed"]
    assert members[0]["worker_id"] in [m["worker_id"] for m in formed[-1]["members"]], "the survivor left"
