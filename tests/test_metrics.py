"""The run's metrics reach Ray's Prometheus endpoint while it trains."""

import socket
import threading
import time
import urllib.request

import pytest
import ray

from elastic import DataConfig, ElasticTrainer, RunConfig, ScalingConfig
from workloads import GLOBAL_BATCH, regression_loop

METRICS = ["elastic_step_time_s", "elastic_world_size", "elastic_samples_per_s", "elastic_step", "elastic_goodput"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_ray_exporting_metrics() -> int:
    """A local Ray that exports metrics on a free port; the port. In one run of the suite in two
    processes, Ray's node did not register within its 30 s, which nothing in this test decides:
    the port found free may have been taken before Ray's agent bound it (the other process starts
    Ray instances too), or the load held the raylet back. So a start that timed out is tried
    once more, on a fresh port."""
    for attempt in range(2):
        port = _free_port()
        try:
            ray.init(address="local", num_cpus=3, log_to_driver=False, _metrics_export_port=port,
                     _system_config={"metrics_report_interval_ms": 1000})
            return port
        except Exception as exc:
            ray.shutdown()
            if attempt or "timed out during startup" not in str(exc):
                raise


@pytest.mark.timeout(180)
def test_step_time_world_size_throughput_and_goodput_are_scraped_from_prometheus(own_ray, tmp_path):
    gate = tmp_path / "scraped-gate"
    port = _init_ray_exporting_metrics()
    try:
        trainer = ElasticTrainer(
            regression_loop,
            # Held at step 40 until every gauge was scraped, so the run outlasts the scrape
            # however slow the machine, and ends as soon as it is done.
            train_loop_config={"max_steps": 60, "sleep_s": 0.05, "gate": (40, str(gate))},
            scaling_config=ScalingConfig(min_workers=2, max_workers=2),
            run_config=RunConfig(name="scraped", storage_path=str(tmp_path)),
            data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=32, max_steps=60),
            show_progress=False,
        )
        fit = threading.Thread(target=trainer.fit, daemon=True)
        fit.start()
        found: set[str] = set()
        while fit.is_alive() and len(found) < len(METRICS):
            time.sleep(1)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
            found = {m for m in METRICS if any(line.startswith(f"ray_{m}{{") and 'run="scraped"' in line
                                                   for line in text.splitlines())}
        gate.touch()
        assert found == set(METRICS)
        fit.join()
    finally:
        ray.shutdown()
