"""The chaos matrix on NCCL: workers sharing one GPU heal deaths to the plain math (issue 38, part 3).

Cells of tests/test_chaos_matrix.py at fast steps, each run's 1-3 workers (4 with a newcomer)
holding a quarter of the one GPU, each a host of its own to NCCL
(`elastic.comm.binding.separate_ranks_sharing_a_gpu`): an outside SIGKILL mid-step, a death
inside the gradient all-reduce, two SIGKILLs within 100 ms, a death inside a heal's formation, a
death while a newcomer's grow forms, and every worker killed (a restart from the checkpoint). Each
must end as it does on gloo (`run_cell`): completed, every sample of every epoch once, the
parameters equal within 1e-9 (float64) to one process training each step's whole batch, and
nobody killed but the victims. Every heal here aborts the stale communicator off the heal's path
(`elastic.comm.retirement`).

Skipped without CUDA; `sh tests/gpu_check.sh` runs it. Written without a GPU at hand (none was
lent): the techniques through a SIGKILL on NCCL (bf16, ZeRO-2 and 3, PowerSGD) are not here yet.
"""

import pytest
import torch

from test_chaos_matrix import CELLS, FAST, DATA_SEED, run_cell
from workloads import regression_reference

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(240)]

GPU_SHARE = 0.25  # three workers and a newcomer on the one GPU
NCCL_CELLS = ("mid-step-sigkill", "mid-allreduce", "two-deaths-within-100ms", "heal-formation",
              "grow-after-newcomer-joined", "every-worker")


@pytest.fixture(scope="module")
def reference():
    return regression_reference(FAST.max_steps, seed=DATA_SEED)


@pytest.mark.parametrize("name", NCCL_CELLS)
def test_workers_sharing_a_gpu_heal_a_death_at_every_moment_over_nccl(local_ray, reference, tmp_path, name):
    result = run_cell(name, CELLS[name], FAST, reference, tmp_path, gpu_share=GPU_SHARE)
    assert [e["kind"] for e in result.events_of("warning")].count("shared_gpu") >= 1
