"""Collective groups bind the interface that carries the Ray node's address (no Ray).

On this machine the hostname resolves to 127.0.0.1 (its /etc/hosts says so), the case in which
gloo, left to the hostname, listens where no other node can reach it.
"""

import ipaddress
import os
import socket

import psutil
import pytest

from elastic.comm import binding
from elastic.comm.binding import GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, bind_collectives_to, interface_of


def _hostname_is_loopback() -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback
    except OSError:
        return False


def _an_interface_address() -> tuple[str, str]:
    """(interface, IPv4 address) of an interface of this machine other than loopback, or loopback's."""
    found = [(name, a.address) for name, addresses in psutil.net_if_addrs().items() for a in addresses
             if a.family == socket.AF_INET]
    return next(((n, a) for n, a in found if not ipaddress.ip_address(a).is_loopback), found[0])


@pytest.fixture
def clean_env():
    """Neither variable set; afterwards both as they were (binding sets them, and the processes
    this one starts later, the network tests' drivers among them, inherit its environment)."""
    names = (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    yield
    for name in names:
        os.environ.pop(name, None)
    os.environ.update(saved)


def test_the_groups_bind_the_interface_that_holds_the_node_address(clean_env):
    interface, address = _an_interface_address()
    assert interface_of(address) == interface
    assert bind_collectives_to(address).startswith(interface)
    assert os.environ[GLOO_SOCKET_IFNAME] == os.environ[NCCL_SOCKET_IFNAME] == interface


def test_an_interface_the_user_chose_is_kept(clean_env):
    os.environ[GLOO_SOCKET_IFNAME] = "mine0"
    assert bind_collectives_to(_an_interface_address()[1]) == f"{GLOO_SOCKET_IFNAME}=mine0 (set by the user)"
    assert os.environ[GLOO_SOCKET_IFNAME] == "mine0"


@pytest.mark.skipif(not _hostname_is_loopback(), reason="this machine's hostname does not resolve to loopback")
def test_a_node_address_no_interface_holds_with_the_hostname_on_loopback_is_refused_naming_the_fix(clean_env):
    with pytest.raises(ValueError, match=r"gloo would bind 127\.\S+ .*resolves to loopback.*no interface here holds "
                       r"the Ray node's address 198\.18\.255\.254\. Set GLOO_SOCKET_IFNAME"):
        bind_collectives_to("198.18.255.254")
    assert GLOO_SOCKET_IFNAME not in os.environ


def test_workers_sharing_a_gpu_are_each_a_host_of_their_own_to_nccl_and_a_whole_gpu_or_the_users_choice_is_kept(
        monkeypatch):
    monkeypatch.delenv(binding.NCCL_HOSTID, raising=False)
    assert binding.separate_ranks_sharing_a_gpu(3, 1.0) is None and binding.NCCL_HOSTID not in os.environ
    assert binding.separate_ranks_sharing_a_gpu(3, 0.0) is None and binding.NCCL_HOSTID not in os.environ
    said = binding.separate_ranks_sharing_a_gpu(3, 0.5)
    assert os.environ[binding.NCCL_HOSTID] == f"{socket.gethostname()}-elastic-worker-3"
    assert "GPU=0.5" in said and "network transport" in said
    monkeypatch.setenv(binding.NCCL_HOSTID, "chosen")
    assert binding.separate_ranks_sharing_a_gpu(4, 0.5) is None and os.environ[binding.NCCL_HOSTID] == "chosen"
