import os
import sys

import pytest
import ray

sys.path.insert(0, os.path.dirname(__file__))

import workloads  # noqa: E402

# Ray workers cannot import the tests folder; ship the shared train loops by value.
ray.cloudpickle.register_pickle_by_value(workloads)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance per test module; ray.init costs seconds here."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible server (moto, in server mode) on a free local port; yields host:port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield f"127.0.0.1:{server._server.server_port}"
    server.stop()
