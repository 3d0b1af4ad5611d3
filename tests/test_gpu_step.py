"""On a GPU, elastic adds no host-device synchronization to a steady step (issue 40, part 1).

Twenty steady steps run under `torch.cuda.set_sync_debug_mode("error")`, which raises at any
call that makes the host wait for the device; the loop itself makes none (it reads no loss), so
an error names a call of elastic's, and fails the run with its traceback. Two checkpoints fall in
them: a snapshot queues its copies to the pinned host buffers without waiting (part 2). Skipped
without CUDA; `sh tests/gpu_check.sh` runs it where there is a GPU. A profile of the same steps
(no checkpoint due) must hold no CUDA runtime call that makes the host wait, on any thread.
"""

import sys
from collections.abc import Callable

import pytest
import ray
import torch

import elastic
from elastic import CheckpointConfig, DataConfig, ElasticTrainer, RunConfig, ScalingConfig
from elastic.checkpoint.checkpoint import take_snapshot
from elastic.checkpoint.host_buffers import HostBuffers
from workloads import GLOBAL_BATCH, build_mlp, regression_data

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(300)]

# The train loop below is defined here; Ray workers cannot import the tests folder.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# DDP times its first ten iterations with CUDA events it synchronizes (`Reducer::should_collect_runtime_stats`,
# and every hundredth after): the watched steps begin after them and end before the hundredth.
WARMUP, WATCHED = 12, 20


def _steady_steps(start: Callable[[], None], stop: Callable[[], None]) -> torch.nn.Module:
    """Train the steady loop; `start()` before the first watched step, `stop()` after the last. Its model."""
    ctx = elastic.get_context()
    model = ctx.prepare_model(build_mlp())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    for step in ctx.steps(regression_data()):
        if step.index == WARMUP:
            start()
        with step:
            for mb in step.micro_batches():
                mb.backward(torch.nn.functional.mse_loss(model(mb.data[0]), mb.data[1]))
            optimizer.step()
            optimizer.zero_grad()
        if step.index == WARMUP + WATCHED - 1:
            stop()
    return model


def _fit_on_the_gpu(loop: Callable[[dict], dict], tmp_path, name: str,
                    checkpoint: CheckpointConfig = CheckpointConfig()) -> elastic.Result:
    """One worker on the GPU runs `loop` for the watched steps and a few beyond."""
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    return ElasticTrainer(
        loop,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), checkpoint_config=checkpoint),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=32, max_steps=WARMUP + WATCHED + 2),
        show_progress=False,
    ).fit()


def watched_loop(config: dict) -> dict:
    model = _steady_steps(lambda: torch.cuda.set_sync_debug_mode("error"),
                          lambda: torch.cuda.set_sync_debug_mode("default"))
    return {"device": str(next(model.parameters()).device)}


def test_a_steady_step_on_a_gpu_makes_the_host_wait_for_the_device_nowhere(tmp_path):
    result = _fit_on_the_gpu(watched_loop, tmp_path, "gpu-steady", CheckpointConfig(every_steps=10))
    assert result.value["device"].startswith("cuda") and result.step == WARMUP + WATCHED + 2


# CUDA runtime calls that make the host wait for the device (cudaMemcpy: the blocking copy).
SYNCHRONIZING = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                           "cudaMemcpy2D"})
WATCHED_END = "test::watched_steps_end"


def profiled_loop(config: dict) -> dict:
    """The watched steps under torch.profiler: every synchronizing CUDA runtime call the process made, with its
    count. No checkpoint is due, so no thread of elastic's has a reason to wait for the device."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])

    def stop() -> None:
        # The profiler's own stop synchronizes the device inside the trace: the marker ends the watched steps.
        with torch.profiler.record_function(WATCHED_END):
            pass
        profiler.stop()

    _steady_steps(profiler.start, stop)
    end = next(event.time_range.start for event in profiler.events() if event.name == WATCHED_END)
    calls: dict[str, int] = {}
    for event in profiler.events():
        if event.name in SYNCHRONIZING and event.time_range.start < end:
            calls[event.name] = calls.get(event.name, 0) + 1
    # The profile saw the device's work at all: the kernels the steps launched.
    launches = sum(event.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")) for event in profiler.events())
    return {"synchronizing": calls, "launches": launches}


def test_a_profile_of_steady_steps_on_a_gpu_holds_no_call_that_makes_the_host_wait(tmp_path):
    # Issue 40, part 1: what the sync debug mode does not see (a stream or event synchronize of
    # another library, a thread of elastic's) shows up in the CUDA runtime calls the profiler records.
    result = _fit_on_the_gpu(profiled_loop, tmp_path, "gpu-profiled")
    assert result.value["launches"] > 0 and result.value["synchronizing"] == {}, result.value


def test_a_snapshot_of_gpu_state_and_a_zero_shard_is_queued_without_the_host_waiting_and_holds_its_steps_state():
    state = {"w": torch.randn(1024, 1024, device="cuda", dtype=torch.float64),
             "m": torch.randn(333, device="cuda"), "rng": torch.get_rng_state()}  # a CPU tensor beside them
    shard = {"tensors": {"exp_avg": torch.randn(4096, device="cuda")}, "steps": 2}  # a ZeRO optimizer's part
    before = {name: tensor.cpu() for name, tensor in state.items()}
    shard_before = shard["tensors"]["exp_avg"].cpu()
    pool = HostBuffers()
    take_snapshot({"s": state}, {"step": 1}, pool=pool).release()  # the pool's pinned buffers, once
    torch.cuda.set_sync_debug_mode("error")
    try:
        snapshot = take_snapshot({"s": state}, {"step": 2}, pool=pool, optimizer_shard=shard)
        state["w"].add_(1.0)  # the next step's write, queued behind the copies on the same stream
        state["m"].mul_(0.0)
        shard["tensors"]["exp_avg"].mul_(0.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    snapshot.wait_copied()
    assert all(buffer.is_pinned() for buffer in snapshot.buffers.values() if buffer.dtype != torch.uint8)
    expected = take_snapshot({"s": before}, {"step": 2})  # the same state, copied from CPU tensors
    assert snapshot.buffers.keys() == expected.buffers.keys()
    for dtype, buffer in expected.buffers.items():
        assert torch.equal(snapshot.buffers[dtype], buffer), dtype
    copied = snapshot.optimizer_shard["tensors"]["exp_avg"]
    assert copied.is_pinned() and torch.equal(copied, shard_before) and snapshot.optimizer_shard["steps"] == 2
    snapshot.release()


def shared_gpu_loop(config: dict) -> dict:
    ctx = elastic.get_context()
    model = ctx.prepare_model(build_mlp())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for step in ctx.steps(regression_data()):
        with step:
            for mb in step.micro_batches():
                mb.backward(torch.nn.functional.mse_loss(model(mb.data[0]), mb.data[1]))
            optimizer.step()
            optimizer.zero_grad()
    return {"params": {k: v.detach().cpu() for k, v in model.module.state_dict().items()}}


def test_two_workers_sharing_one_gpu_train_over_nccl_and_heal_a_death_to_the_plain_math(tmp_path):
    # Issue 38, part 1: GPU=0.5 puts both workers on the one GPU, which NCCL refuses unless each
    # is a host of its own to it (NCCL_HOSTID, `elastic.comm.binding.separate_ranks_sharing_a_gpu`).
    # Not yet run on a GPU: no device was lent when it was written.
    from workloads import regression_reference

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    result = ElasticTrainer(
        shared_gpu_loop,
        scaling_config=ScalingConfig(num_workers=(1, 2), use_gpu=True, resources_per_worker={"GPU": 0.5}),
        run_config=RunConfig(name="gpu-shared", storage_path=str(tmp_path)),
        data_config=DataConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=32, max_steps=24, seed=3),
        faults=[elastic.Fault(kind="kill", rank=1, step=10, where="allreduce")], show_progress=False,
    ).fit()
    assert result.step == 24
    assert [e["kind"] for e in result.events_of("warning")] == ["shared_gpu"]
    assert "heal" in [e["kind"] for e in result.events_of("generation_formed")]
    for name, value in regression_reference(24, seed=3)["params"].items():
        torch.testing.assert_close(result.value["params"][name], value, rtol=1e-9, atol=1e-12)
