#!/bin/sh
# The GPU checks as one script, for a machine with CUDA (run from the repository root):
#
#     sh tests/gpu_check.sh
#
# NCCL groups are formed, aborted and re-formed in the same process (world size 1; 2 where
# there are two GPUs), CUDA state travels as flat buffers in the healing sync, and the NCCL
# watchdog mode cannot tear a survivor down, a rank waits for NCCL's collectives to land before
# it commits what they wrote (tests/test_nccl_landing.py), and a steady step makes the host wait for the
# device nowhere (tests/test_gpu_step.py), and workers sharing the GPU heal every kind of death
# to the plain math while the stale communicator is aborted off the heal's path
# (tests/test_nccl_chaos.py). Without CUDA these tests skip, so the script
# refuses to run instead of passing vacuously.
# Each part runs under its own timeout, and a part that fails or times out does not stop the next:
# on a lent GPU's short budget every part's outcome counts. The exit status is 1 if any part failed.
# CHAOS selects the chaos matrix's cells by pytest's -k (all by default), e.g.
#     CHAOS="mid-allreduce or every-worker or zero3" sh tests/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
$PYTHON -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'; print(torch.cuda.get_device_name(0))" \
    || exit 2
status=0
timeout 200 $PYTHON -m pytest --noconftest -q -rs tests/test_generations.py tests/test_state_sync.py \
    tests/test_nccl_survival.py tests/test_nccl_landing.py || status=1
# A steady step under CUDA's sync debug mode, and two workers sharing the GPU, through real Ray
# runs (Ray must be installed); then the chaos matrix's cells on NCCL, 3-4 workers sharing the GPU.
timeout 200 $PYTHON -m pytest -q -rs tests/test_gpu_step.py || status=1
timeout 420 $PYTHON -m pytest -q -rs tests/test_nccl_chaos.py ${CHAOS:+-k "$CHAOS"} || status=1
exit $status
