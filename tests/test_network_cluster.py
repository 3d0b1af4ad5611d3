"""The network-namespace cluster harness itself (elastic.testing.NetworkCluster): its nodes are
separate hosts on a real Ray cluster, and partition, heal, flap and shape do to a link what they say.

One cluster, a head and two workers of 1 CPU each, serves the module: starting Ray in three
namespaces takes seconds per node here. The last test tears it down and checks that nothing is left.
The tests on a cluster run under `-m soak` (the suite's time on 2 cores): in CI the harness
starts, partitions and heals a node's link in tests/test_partitions.py, and a dead owner's
leftovers are removed here.
"""

import ipaddress
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from elastic.testing import ETC_NETNS, NAME_PREFIX, NetworkCluster, remove_leftovers

pytestmark = pytest.mark.skipif(NetworkCluster.unavailable() is not None, reason=str(NetworkCluster.unavailable()))

# A reachable node answers a connect within a millisecond here: none within a second is cut off.
CUT_OFF_WAIT_S = 1.0
# Right after a heal a connect can wait out the ARP and TCP retransmit timers that ran while the
# link was down (up to a second each), as after a real link comes back.
REACH_WAIT_S = 5.0
TRANSFER_S = 1.0
SHAPED_RATE_MBIT = 100
# Unshaped, a socket between two namespaces carries several Gbit/s here.
UNSHAPED_FLOOR_MBIT = 400

# Accepts connections until killed; prints its port first.
LISTENER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
while True:
    server.accept()[0].close()
"""

CONNECT = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
"""

# Counts what arrives until the sender closes; prints its port first, then the rate in Mbit/s
# from the first byte to the last.
RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
received, started = 0, None
while chunk := connection.recv(1 << 20):
    started = started or time.monotonic()
    received += len(chunk)
print(received * 8 / (time.monotonic() - started) / 1e6, flush=True)
"""

SENDER = """
import socket, sys, time
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
block, until = bytes(1 << 20), time.monotonic() + float(sys.argv[3])
while time.monotonic() < until:
    connection.sendall(block)
connection.close()
"""

# Runs inside the head's namespace: one task pinned to each node reports the address Ray knows
# its node by, and the source address its own namespace's kernel picks to reach the head.
PINNED_TASKS_DRIVER = """
import json, socket, ray
from elastic.testing import on_node

def addresses(head_ip):
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((head_ip, 9))
    return ray.util.get_node_ip_address(), probe.getsockname()[0]

ray.init()
alive = sorted(node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])
task = ray.remote(addresses)
head_ip = ray.util.get_node_ip_address()
pinned = ray.get([task.options(**on_node(node)).remote(head_ip) for node in range(3)])
print(json.dumps({"alive": alive, "pinned": pinned}))
"""


@pytest.fixture(scope="module")
def cluster():
    with NetworkCluster(nodes=3, cpus_per_node=1) as cluster:
        yield cluster


@pytest.fixture
def healed_links(cluster):
    """Every link healed and unshaped after the test, whatever it left, so one failure stays one."""
    yield
    for node in range(cluster.nodes):
        cluster.heal(node)
        cluster.shape(node, None)


def _python(code, *args):
    return [sys.executable, "-c", code, *map(str, args)]


def _listen(cluster, node):
    listener = cluster.spawn_in(node, _python(LISTENER, cluster.node_ip(node)), stdout=subprocess.PIPE, text=True)
    return int(listener.stdout.readline())


def _connects(cluster, src, dst, port, within_s):
    connect = cluster.run_in(src, _python(CONNECT, cluster.node_ip(dst), port, within_s), timeout_s=30)
    return connect.returncode == 0


def _throughput_mbit(cluster, src, dst):
    receiver = cluster.spawn_in(dst, _python(RECEIVER, cluster.node_ip(dst)), stdout=subprocess.PIPE, text=True)
    port = int(receiver.stdout.readline())
    sender = cluster.run_in(src, _python(SENDER, cluster.node_ip(dst), port, TRANSFER_S), timeout_s=60)
    assert sender.returncode == 0, sender.stderr
    rate = float(receiver.stdout.readline())
    receiver.wait(timeout=10)
    return rate


def _namespaces():
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _pids_in(namespace):
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True).stdout.split()


def _running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_a_driver_in_the_head_namespace_runs_a_task_on_each_node_at_that_nodes_own_address(cluster):
    result = cluster.run_driver(PINNED_TASKS_DRIVER, timeout_s=180)
    assert result.returncode == 0, result.stderr

    report = json.loads(result.stdout.strip().splitlines()[-1])
    ips = [cluster.node_ip(node) for node in range(3)]
    assert report["alive"] == sorted(ips)
    assert report["pinned"] == [[ip, ip] for ip in ips]
    assert cluster.address == f"{ips[0]}:6379"
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network("198.18.0.0/15") for ip in ips)


@pytest.mark.soak
@pytest.mark.timeout(60)
def test_the_hostname_resolves_to_the_nodes_own_address_inside_its_namespace(cluster):
    resolve = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    lookup = cluster.run_in(1, _python(resolve), timeout_s=30)
    assert lookup.stdout.strip() == cluster.node_ip(1)


@pytest.mark.soak
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("healed_links")
def test_partition_cuts_only_that_node_off_and_heal_restores_it(cluster):
    ports = {node: _listen(cluster, node) for node in (1, 2)}
    assert _connects(cluster, 0, 2, ports[2], REACH_WAIT_S) and _connects(cluster, 0, 1, ports[1], REACH_WAIT_S)

    cluster.partition(2)
    assert not _connects(cluster, 0, 2, ports[2], CUT_OFF_WAIT_S)
    assert not _connects(cluster, 1, 2, ports[2], CUT_OFF_WAIT_S)
    assert _connects(cluster, 0, 1, ports[1], REACH_WAIT_S)

    cluster.heal(2)
    assert _connects(cluster, 0, 2, ports[2], REACH_WAIT_S)
    assert _connects(cluster, 1, 2, ports[2], REACH_WAIT_S)


@pytest.mark.soak
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("healed_links")
def test_a_flap_takes_the_link_down_and_leaves_it_up(cluster):
    port = _listen(cluster, 2)
    flap = cluster.flap(2, down_s=3.0, up_s=0.1, times=1)
    assert not _connects(cluster, 0, 2, port, CUT_OFF_WAIT_S)
    flap.join(timeout=30)
    assert not flap.is_alive()
    assert _connects(cluster, 0, 2, port, REACH_WAIT_S)


@pytest.mark.soak
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("healed_links")
def test_shaping_a_link_bounds_its_throughput_each_way_and_removing_it_lifts_the_bound(cluster):
    assert _throughput_mbit(cluster, 0, 1) > UNSHAPED_FLOOR_MBIT

    cluster.shape(1, f"{SHAPED_RATE_MBIT}mbit")
    into_node, out_of_node = _throughput_mbit(cluster, 0, 1), _throughput_mbit(cluster, 1, 0)
    assert SHAPED_RATE_MBIT / 2 < into_node < 2 * SHAPED_RATE_MBIT
    assert SHAPED_RATE_MBIT / 2 < out_of_node < 2 * SHAPED_RATE_MBIT
    assert _throughput_mbit(cluster, 0, 2) > UNSHAPED_FLOOR_MBIT

    cluster.shape(1, None)
    assert _throughput_mbit(cluster, 0, 1) > UNSHAPED_FLOOR_MBIT


@pytest.mark.timeout(60)
def test_a_dead_owners_leftover_namespace_is_removed_with_its_processes():
    owner = subprocess.Popen(["true"])
    owner.wait()  # a pid that no longer runs, as a test process's killed before its teardown
    leftover = f"{NAME_PREFIX}-{owner.pid}-0-n0"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    (ETC_NETNS / leftover).mkdir(parents=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "600"])
    while str(orphan.pid) not in _pids_in(leftover):
        time.sleep(0.05)

    remove_leftovers()

    assert orphan.wait(timeout=10) != 0
    assert leftover not in _namespaces()
    assert not (ETC_NETNS / leftover).exists()


@pytest.mark.soak
@pytest.mark.timeout(60)
def test_teardown_leaves_no_namespace_process_or_file_behind(cluster):
    prefix = cluster.namespace(0).removesuffix("-n0")
    cluster_dir = os.path.dirname(cluster.env["RAY_AUTH_TOKEN_PATH"])
    pids = _pids_in(cluster.namespace(0)) + _pids_in(cluster.namespace(1))
    assert cluster.namespace(2) in _namespaces() and pids and os.path.isdir(cluster_dir)

    cluster.close()

    assert [name for name in _namespaces() if name.startswith(f"{prefix}-")] == []
    assert [pid for pid in map(int, pids) if _running(pid)] == []
    assert [path for path in ETC_NETNS.glob(f"{prefix}-*")] == []
    assert not os.path.exists(cluster_dir)
