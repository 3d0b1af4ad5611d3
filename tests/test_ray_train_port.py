"""Ray Train's own PyTorch example, ported by changing its imports (`examples/ray_train_port.py`),
trains on elastic and heals an outside SIGKILL of a worker mid-epoch in place."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from workloads import OutsideKiller

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import ray_train_port  # noqa: E402

# Ray workers cannot import examples/: ship the example's train loop by value.
ray.cloudpickle.register_pickle_by_value(ray_train_port)

pytestmark = pytest.mark.timeout(240)


def test_ray_trains_own_example_ported_by_its_imports_heals_an_outside_kill_mid_epoch_in_place(local_ray, tmp_path):
    killer = OutsideKiller("mid-step", str(tmp_path), "fashion-mnist", SimpleNamespace(compute_s=0.05), seed=1,
                           victim=1, world_size=2, from_step=20)
    killer.start()
    result = ray_train_port.train_fashion_mnist(str(tmp_path), sleep_s=0.05, show_progress=False)
    assert killer.done.wait(60) and killer.killed, "the outside kill never happened"
    steps = 2 * ray_train_port.TRAIN_SAMPLES // ray_train_port.GLOBAL_BATCH_SIZE
    assert result.step == steps
    [died] = result.events_of("worker_failed")
    assert died["kind"] == "death"
    formed = [e["kind"] for e in result.events_of("generation_formed")]
    assert "heal" in formed and not result.events_of("run_resumed"), formed  # in place, not from a checkpoint
    assert all(e["steps_lost"] <= 1 for e in result.events_of("recovery"))
    assert set(result.metrics) >= {"loss", "accuracy"} and not result.events_of("warning")
