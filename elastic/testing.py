"""A real multi-node Ray cluster on one machine, one Linux network namespace per node, whose links
a test can cut, flap and slow down: a public testing tool beside fault injection.

    from elastic.testing import NetworkCluster

    reason = NetworkCluster.unavailable()        # None, or why it cannot run here (skip with it)
    with NetworkCluster(nodes=3, cpus_per_node=1) as cluster:
        result = cluster.run_driver('''
    import ray
    from elastic.testing import on_node
    ray.init()                                   # RAY_ADDRESS and the auth token come from the env
    print(ray.get(ray.remote(ray.util.get_node_ip_address).options(**on_node(2)).remote()))
    ''', timeout_s=120)
        assert result.stdout.strip() == cluster.node_ip(2)
        cluster.partition(2)                     # node 2 is alive and unreachable
        cluster.heal(2)
        cluster.shape(1, "100mbit")              # node 1's link carries 100 Mbit/s each way
        cluster.flap(1, down_s=1, up_s=2, times=3).join()

Node 0 is the head; nodes 1..n-1 are workers. Each node is a namespace `elastic-netns-<pid>-<k>-n<i>`
with one interface, `eth0`, at 198.18.<k>.<i+1>, whose other end `n<i>` is a port of a bridge
that lives in a namespace of its own (`...-bridge`). Nothing is added to the machine's own
network: the addresses come from 198.18.0.0/15, the range set aside for benchmarking networks,
and only exist inside these namespaces.

| call | what it does to node i's link |
|---|---|
| `partition(i)` | takes the bridge's end of the link down: packets to and from node i vanish, connects time out (no reset, as with a pulled cable) |
| `heal(i)` | brings it back up |
| `shape(i, "100mbit")` | a token bucket (`tc tbf`) on both ends, so each direction carries at most that rate; `None` removes it |
| `flap(i, down_s, up_s, times)` | partitions and heals in a background thread; returns the thread to join |
| `cut(i, j)` | a partial partition: nodes i and j stop reaching each other (both ways), each still reaches every other node |
| `mend(i, j)` | undoes `cut(i, j)` |

**The driver runs inside the head's namespace** (`run_driver`, `spawn_driver`), like a Ray Job's
driver on a head machine. The other way, a veth from the test's own (root) namespace into the
bridge, would put a 198.18 address and route into the machine's own network, where the test
process and any other Ray on the machine live, and the driver would then reach the cluster over
a link no `partition` can cut. `run_in` and `spawn_in` run any command on any node.

**Placing work on a node.** Node i carries one unit of the custom resource `node_resource(i)`
(`"elastic_node_<i>"`); ask for a sliver of it, `.options(**on_node(i))`, to run a task or actor
there. Ray's own `node:<ip>` resource, with `node_ip(i)`, works too.

**Authentication stays on.** The cluster makes its own token, in a file of its temporary
directory, and every process it starts gets `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN_PATH` (see
`env`). `~/.ray/auth_token`, which a plain `ray start --head` would write, is never touched, so
another Ray on the machine keeps its own token.

**The hostname.** All namespaces share the machine's hostname. Each gets an `/etc/hosts` (as
`/etc/netns/<namespace>/hosts`, which `ip netns exec` mounts over `/etc/hosts`) that maps the
hostname to the node's own address, as on a real node, or with `hosts_loopback=True` to
127.0.0.1 as this machine's `/etc/hosts` does: what a library that binds to "my hostname's
address" (gloo does) gets wrong on a multi-node cluster. Its `resolv.conf` names a nameserver on
the node's loopback, where none listens, so a lookup fails at once instead of waiting out the
timeout of a nameserver the namespace cannot reach.

**Teardown** (leaving the `with`, on an exception too): every process in the cluster's
namespaces is sent SIGTERM, then SIGKILL, then the namespaces, the bridge, `/etc/netns` entries
and the temporary directory (Ray's `--temp-dir` for each node) go. `ray stop` is never run: it
would stop every Ray on the machine. A cluster left behind by a process that died without
tearing down (killed by SIGKILL) is removed by the next `NetworkCluster` to start.

Needs Linux, root and iproute2 (`ip`, `tc`); `NetworkCluster.unavailable()` says what is missing.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

# The benchmarking range (RFC 2544): never routed, so it cannot clash with a real network.
# Each cluster takes one /24 of it; node i is host i+1 of that /24.
ADDRESS_RANGE = ipaddress.ip_network("198.18.0.0/15")
CLUSTER_PREFIXLEN = 24
CLUSTER_SUBNETS = list(ADDRESS_RANGE.subnets(new_prefix=CLUSTER_PREFIXLEN))
MAX_NODES = 2 ** (32 - CLUSTER_PREFIXLEN) - 2

# Namespaces, /etc/netns entries and temporary directories are named
# "elastic-netns-<owner pid>-<subnet index>[-<role>]", so a leftover's owner can be checked.
NAME_PREFIX = "elastic-netns"
_NAME_PATTERN = re.compile(rf"^{NAME_PREFIX}-(?P<pid>\d+)-(?P<index>\d+|probe)(?:-|$)")
ETC_NETNS = Path("/etc/netns")
BRIDGE = "bridge0"
NODE_INTERFACE = "eth0"
# A locally administered unicast address no interface here has: where `cut` sends a node's frames.
NOWHERE_MAC = "02:00:00:00:00:01"

# Each node has a network of its own, so every node can use Ray's default GCS port.
GCS_PORT = 6379
DEFAULT_OBJECT_STORE_BYTES = 256 * 1024**2
NODE_RESOURCE_PREFIX = "elastic_node_"
# What `on_node` asks of a node's resource (it has 1): small enough for many tasks at once.
ON_NODE_AMOUNT = 0.001

# tc tbf needs a bucket and a queue bound; a burst of 256 KB lets a 1gbit link keep its rate.
TBF_BURST = "256kb"
TBF_LATENCY = "20ms"

RAY_START_TIMEOUT_S = 120.0
_CAPTURED = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}  # a `ray start`'s output
DRIVER_TIMEOUT_S = 300.0
# Ray's GCS and raylets linger on SIGTERM while their peers go down too; what else runs on a
# node (drivers, workers) gets this long to exit cleanly before everything is killed.
TERMINATE_GRACE_S = 1.0
KILL_WAIT_S = 5.0
IP_COMMAND_TIMEOUT_S = 30.0

# Environment variables that name a Ray cluster: a namespace's processes get this cluster's,
# never ones inherited from the test process.
_CLUSTER_ENV_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

# Subnet indexes are chosen under this lock, so two clusters of one process never share one.
_allocation_lock = threading.Lock()


def node_resource(node: int) -> str:
    """The custom resource that only node `node` has (one unit of it)."""
    return f"{NODE_RESOURCE_PREFIX}{node}"


def on_node(node: int) -> dict:
    """Options that place a task or actor on node `node`: `f.options(**on_node(2)).remote()`."""
    return {"resources": {node_resource(node): ON_NODE_AMOUNT}}


class NetworkCluster:
    """A Ray cluster of `nodes` nodes (node 0 the head), each in its own network namespace.

    Use it as a context manager; leaving it tears everything down."""

    def __init__(
        self,
        nodes: int = 3,
        cpus_per_node: int = 1,
        head_cpus: int | None = None,
        rate: str | None = None,
        hosts_loopback: bool = False,
        object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES,
    ) -> None:
        """`head_cpus` defaults to `cpus_per_node`; `rate` (e.g. "1gbit") shapes every node's link
        from the start; `hosts_loopback` maps the hostname to 127.0.0.1 instead of the node's IP."""
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes}: a NetworkCluster has 1 to {MAX_NODES} nodes")
        head_cpus = cpus_per_node if head_cpus is None else head_cpus
        if cpus_per_node < 0 or head_cpus < 0:
            raise ValueError(f"cpus_per_node={cpus_per_node}, head_cpus={head_cpus}: CPUs cannot be negative")
        self.nodes = nodes
        self._cpus = [head_cpus] + [cpus_per_node] * (nodes - 1)
        self._initial_rate = rate
        self._hosts_loopback = hosts_loopback
        self._object_store_bytes = object_store_bytes
        self._prefix: str | None = None
        self._subnet: ipaddress.IPv4Network | None = None
        self._shaped: set[int] = set()
        self._spawned: list[subprocess.Popen] = []
        self._flaps: list[threading.Thread] = []
        self._closing = threading.Event()

    # ---- availability --------------------------------------------------------------------

    @staticmethod
    def unavailable() -> str | None:
        """Why a NetworkCluster cannot run on this machine, or None when it can."""
        return _unavailable_reason()

    # ---- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> NetworkCluster:
        reason = self.unavailable()
        if reason is not None:
            raise RuntimeError(f"NetworkCluster cannot run here: {reason}")
        remove_leftovers()
        with _allocation_lock:
            index = _free_subnet_index()
            self._prefix = f"{NAME_PREFIX}-{os.getpid()}-{index}"
            self._subnet = CLUSTER_SUBNETS[index]
            # Creating the bridge's namespace claims the index before the lock is released.
            _ip("netns", "add", self._bridge_namespace)
        try:
            self._build_network()
            self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process on the cluster's nodes and remove all it made. Safe to call twice."""
        if self._prefix is None:
            return
        self._closing.set()
        for flap in self._flaps:
            flap.join()
        _remove_cluster(self._prefix)
        for process in self._spawned:
            process.wait()  # reap what we spawned; teardown has already killed it
        self._prefix = None

    # ---- addresses -----------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address, for `ray.init(address=...)` inside a node's namespace."""
        return f"{self.node_ip(0)}:{GCS_PORT}"

    @property
    def env(self) -> dict[str, str]:
        """What a Ray driver needs to join this cluster; every process the cluster starts gets it."""
        return {
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self._token_path),
        }

    def node_ip(self, node: int) -> str:
        self._check_node(node)
        return str(self._subnet.network_address + 1 + node)

    def namespace(self, node: int) -> str:
        """The name of node `node`'s network namespace, for `ip netns exec`."""
        self._check_node(node)
        return f"{self._prefix}-n{node}"

    # ---- running things on a node --------------------------------------------------------

    def run_in(
        self, node: int, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None
    ) -> subprocess.CompletedProcess:
        """Run `argv` on node `node` and return it finished, with its output as text."""
        return subprocess.run(
            self._in_namespace(node, argv), env=self._process_env(env),
            capture_output=True, text=True, timeout=timeout_s,
        )

    def spawn_in(
        self, node: int, argv: list[str], env: dict[str, str] | None = None, **popen_kwargs
    ) -> subprocess.Popen:
        """Start `argv` on node `node`; teardown kills it if it is still running."""
        process = subprocess.Popen(self._in_namespace(node, argv), env=self._process_env(env), **popen_kwargs)
        self._spawned.append(process)
        return process

    def run_driver(
        self, program: str | Path, args: Sequence[str] = (), env: dict[str, str] | None = None,
        timeout_s: float = DRIVER_TIMEOUT_S,
    ) -> subprocess.CompletedProcess:
        """Run a Python driver on the head node: `program` is code (a str) or a script (a Path)."""
        return self.run_in(0, _python_argv(program, args), env=env, timeout_s=timeout_s)

    def spawn_driver(
        self, program: str | Path, args: Sequence[str] = (), env: dict[str, str] | None = None, **popen_kwargs
    ) -> subprocess.Popen:
        """Start a Python driver on the head node, as `run_driver` but without waiting."""
        return self.spawn_in(0, _python_argv(program, args), env=env, **popen_kwargs)

    # ---- the links -----------------------------------------------------------------------

    def partition(self, node: int) -> None:
        """Cut node `node` off: its link goes down, the node and its processes keep running."""
        self._check_node(node)
        _ip("-n", self._bridge_namespace, "link", "set", self._bridge_port(node), "down")

    def heal(self, node: int) -> None:
        """Bring node `node`'s link back up. The first packets across it may wait out ARP and TCP
        retransmit timers that ran while it was down, up to about a second, as on a real link."""
        self._check_node(node)
        _ip("-n", self._bridge_namespace, "link", "set", self._bridge_port(node), "up")

    def cut(self, node_a: int, node_b: int) -> None:
        """Stop nodes `node_a` and `node_b` reaching each other, both ways, while each still reaches
        every other node: a partial partition, as a faulty switch port or route makes. Each node's
        neighbour entry for the other names a hardware address no interface has, so their frames
        vanish in the bridge (no reset, no error: TCP retransmits into the void)."""
        for here, there in ((node_a, node_b), (node_b, node_a)):
            _ip("-n", self.namespace(here), "neigh", "replace", self.node_ip(there), "lladdr", NOWHERE_MAC,
                "dev", NODE_INTERFACE, "nud", "permanent")

    def mend(self, node_a: int, node_b: int) -> None:
        """Undo `cut(node_a, node_b)`: each node learns the other's hardware address again by ARP."""
        for here, there in ((node_a, node_b), (node_b, node_a)):
            _ip("-n", self.namespace(here), "neigh", "del", self.node_ip(there), "dev", NODE_INTERFACE)

    def restart(self, node: int) -> None:
        """Start worker node `node`'s Ray again, as an operator brings a machine back: after Ray
        declared it dead (its raylet then ends), it joins the cluster as a new node. Whatever still
        runs in its namespace is stopped first."""
        self._check_node(node)
        if node == 0:
            raise ValueError("the head cannot be restarted: it holds the cluster; make a new NetworkCluster")
        _kill_processes_in([self.namespace(node)])
        _wait_ray_start(node, self.spawn_in(node, self._ray_start_argv(node, head=False), **_CAPTURED))

    def shape(self, node: int, rate: str | None) -> None:
        """Limit each direction of node `node`'s link to `rate` (tc units: "100mbit", "1gbit");
        None removes the limit."""
        self._check_node(node)
        # The bridge's end sends what node i receives and node i's end what it sends: a qdisc
        # shapes only what leaves an interface, so a link shaped both ways needs both ends.
        for namespace, interface in self._link_ends(node):
            if rate is None:
                if node in self._shaped:
                    _tc("-n", namespace, "qdisc", "del", "dev", interface, "root")
            else:
                _tc("-n", namespace, "qdisc", "replace", "dev", interface, "root",
                    "tbf", "rate", rate, "burst", TBF_BURST, "latency", TBF_LATENCY)
        if rate is None:
            self._shaped.discard(node)
        else:
            self._shaped.add(node)

    def flap(self, node: int, down_s: float, up_s: float, times: int) -> threading.Thread:
        """Partition node `node` for `down_s`, heal it for `up_s`, `times` times, in a background
        thread; returns the thread. The link is left up; teardown stops a flap early."""
        self._check_node(node)
        thread = threading.Thread(
            target=self._flap, args=(node, down_s, up_s, times), name=f"flap-node-{node}", daemon=True
        )
        self._flaps.append(thread)
        thread.start()
        return thread

    def _flap(self, node: int, down_s: float, up_s: float, times: int) -> None:
        for _ in range(times):
            self.partition(node)
            closing = self._closing.wait(down_s)
            self.heal(node)
            if closing or self._closing.wait(up_s):
                return

    # ---- building ------------------------------------------------------------------------

    @property
    def _bridge_namespace(self) -> str:
        return f"{self._prefix}-bridge"

    @property
    def _cluster_dir(self) -> Path:
        return _cluster_dir(self._prefix)

    @property
    def _token_path(self) -> Path:
        return self._cluster_dir / "auth_token"

    @staticmethod
    def _bridge_port(node: int) -> str:
        return f"n{node}"

    def _link_ends(self, node: int) -> list[tuple[str, str]]:
        return [(self._bridge_namespace, self._bridge_port(node)), (self.namespace(node), NODE_INTERFACE)]

    def _check_node(self, node: int) -> None:
        if self._prefix is None:
            raise RuntimeError(
                "the NetworkCluster is not running; use it as `with NetworkCluster(...) as cluster:`"
            )
        if not 0 <= node < self.nodes:
            raise ValueError(f"node={node}: this cluster has nodes 0 to {self.nodes - 1}")

    def _build_network(self) -> None:
        bridge_ns = self._bridge_namespace
        _ip("-n", bridge_ns, "link", "add", "name", BRIDGE, "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", BRIDGE, "up")
        hostname = socket.gethostname()
        for node in range(self.nodes):
            namespace, ip = self.namespace(node), self.node_ip(node)
            self._write_hosts(namespace, hostname, "127.0.0.1" if self._hosts_loopback else ip)
            _ip("netns", "add", namespace)
            port = self._bridge_port(node)
            _ip("-n", bridge_ns, "link", "add", "name", port, "type", "veth",
                "peer", "name", NODE_INTERFACE, "netns", namespace)
            _ip("-n", bridge_ns, "link", "set", port, "master", BRIDGE)
            _ip("-n", bridge_ns, "link", "set", port, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "addr", "add", f"{ip}/{CLUSTER_PREFIXLEN}", "dev", NODE_INTERFACE)
            _ip("-n", namespace, "link", "set", NODE_INTERFACE, "up")
            # Whatever finds its own address by routing towards a public one (Ray without an
            # address, many libraries) gets the node's IP; such packets die at the bridge.
            _ip("-n", namespace, "route", "add", "default", "dev", NODE_INTERFACE)
            if self._initial_rate is not None:
                self.shape(node, self._initial_rate)

    @staticmethod
    def _write_hosts(namespace: str, hostname: str, hostname_address: str) -> None:
        directory = ETC_NETNS / namespace
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text(
            f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n{hostname_address} {hostname}\n"
        )
        # The machine's nameserver is not reachable from the namespaces: a lookup would wait out
        # the resolver's 5 s timeout (TCPStore's client looks its peer up as it connects), where a
        # real node's DNS answers at once. Loopback has no server, so lookups fail at once instead.
        (directory / "resolv.conf").write_text("nameserver 127.0.0.1\n")

    def _start_ray(self) -> None:
        self._cluster_dir.mkdir()
        self._token_path.write_text(secrets.token_hex(32))
        self._token_path.chmod(0o600)
        _wait_ray_start(0, self.spawn_in(0, self._ray_start_argv(0, head=True), **_CAPTURED))
        # Workers join the head together: each `ray start` returns once its node is registered.
        starting = {node: self.spawn_in(node, self._ray_start_argv(node, head=False), **_CAPTURED)
                    for node in range(1, self.nodes)}
        for node, process in starting.items():
            _wait_ray_start(node, process)

    def _ray_start_argv(self, node: int, head: bool) -> list[str]:
        argv = [str(Path(sys.executable).parent / "ray"), "start"]
        if head:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        return argv + [
            f"--node-ip-address={self.node_ip(node)}",
            f"--temp-dir={self._cluster_dir / f'n{node}'}",
            f"--num-cpus={self._cpus[node]}",
            # Each node would otherwise claim every GPU of the machine.
            "--num-gpus=0",
            f"--resources={json.dumps({node_resource(node): 1})}",
            f"--object-store-memory={self._object_store_bytes}",
            "--disable-usage-stats",
        ]

    def _in_namespace(self, node: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node), *map(str, argv)]

    def _process_env(self, overrides: dict[str, str] | None) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in _CLUSTER_ENV_VARS}
        return env | self.env | (overrides or {})


def _python_argv(program: str | Path, args: Sequence[str]) -> list[str]:
    if isinstance(program, Path):
        return [sys.executable, str(program), *args]
    return [sys.executable, "-c", program, *args]


def _wait_ray_start(node: int, process: subprocess.Popen) -> None:
    try:
        output, _ = process.communicate(timeout=RAY_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise RuntimeError(f"`ray start` on node {node} took over {RAY_START_TIMEOUT_S}s:\n{output}") from None
    if process.returncode != 0:
        raise RuntimeError(f"`ray start` on node {node} failed with exit status {process.returncode}:\n{output}")


# ---- the machine's namespaces ------------------------------------------------------------


def remove_leftovers() -> None:
    """Remove every cluster whose owning process has died: its processes, namespaces,
    /etc/netns entries and temporary directory. Clusters of live processes are left alone."""
    names = set(_our_namespaces()) | {path.name for path in _our_paths(ETC_NETNS)} | {
        path.name for path in _our_paths(Path(tempfile.gettempdir()))
    }
    dead_prefixes = set()
    for name in names:
        match = _NAME_PATTERN.match(name)
        if not _pid_alive(int(match["pid"])):
            dead_prefixes.add(f"{NAME_PREFIX}-{match['pid']}-{match['index']}")
    for prefix in dead_prefixes:
        _remove_cluster(prefix)


def _remove_cluster(prefix: str) -> None:
    namespaces = [name for name in _our_namespaces() if name == prefix or name.startswith(f"{prefix}-")]
    _kill_processes_in(namespaces)
    for namespace in namespaces:
        _ip("netns", "delete", namespace)
    for path in _our_paths(ETC_NETNS):
        if path.name == prefix or path.name.startswith(f"{prefix}-"):
            shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(_cluster_dir(prefix), ignore_errors=True)


def _kill_processes_in(namespaces: list[str]) -> None:
    """SIGTERM every process in the namespaces, SIGKILL what is left after a grace period.
    A namespace outlives `ip netns delete` while a process is inside, so none may remain."""
    for sig, wait_s in ((signal.SIGTERM, TERMINATE_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        for pid in _pids_in(namespaces):
            _signal(pid, sig)
        deadline = time.monotonic() + wait_s
        while _pids_in(namespaces) and time.monotonic() < deadline:
            time.sleep(0.1)
    left = _pids_in(namespaces)
    if left:
        raise RuntimeError(f"processes {sorted(left)} in {namespaces} survived SIGKILL; they block teardown")


def _pids_in(namespaces: list[str]) -> set[int]:
    pids = set()
    for namespace in namespaces:
        pids.update(int(pid) for pid in _ip("netns", "pids", namespace).split())
    return pids


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it exited between the listing and the signal


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _our_namespaces() -> list[str]:
    # `ip netns list` prints "name" or "name (id: N)", one a line.
    names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    return [name for name in names if _NAME_PATTERN.match(name)]


def _our_paths(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [path for path in directory.iterdir() if _NAME_PATTERN.match(path.name)]


def _cluster_dir(prefix: str) -> Path:
    # Short on purpose: Ray's unix sockets live under it, and their paths are limited to 107 bytes.
    return Path(tempfile.gettempdir()) / prefix


def _free_subnet_index() -> int:
    used = {int(_NAME_PATTERN.match(name)["index"]) for name in _our_namespaces() if not name.endswith("-probe")}
    for index in range(len(CLUSTER_SUBNETS)):
        if index not in used:
            return index
    raise RuntimeError(f"all {len(CLUSTER_SUBNETS)} subnets of {ADDRESS_RANGE} are in use by NetworkClusters")


def _ip(*args: str) -> str:
    return _command("ip", *args)


def _tc(*args: str) -> str:
    return _command("tc", *args)


def _command(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=IP_COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed with exit status {result.returncode}: {result.stderr.strip()}")
    return result.stdout


@functools.cache
def _unavailable_reason() -> str | None:
    if sys.platform != "linux":
        return f"network namespaces need Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root; this process runs as uid {os.geteuid()}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed; install iproute2"
    ray = Path(sys.executable).parent / "ray"
    if not ray.exists():
        return f"no `ray` executable beside {sys.executable}; install ray into this environment"
    # Root is not enough in every container: try what a cluster does, in a namespace of its own.
    probe = f"{NAME_PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", "name", BRIDGE, "type", "bridge")
            _ip("-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1")
            _tc("-n", probe, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "1gbit",
                "burst", TBF_BURST, "latency", TBF_LATENCY)
        finally:
            _ip("netns", "delete", probe)
    except RuntimeError as error:
        return f"this machine cannot build a namespaced network: {error}"
    return None
