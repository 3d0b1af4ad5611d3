"""torchft on the goodput workload: four replica groups of one process each, restarted when killed.

`main(out_dir)` (or `python -m benchmarks.goodput_torchft OUT_DIR`) is the supervisor. It runs a
torchft Lighthouse inside itself (bound to loopback), starts WORKERS replica processes
(`python -m benchmarks.goodput_torchft --replica R OUT_DIR LIGHTHOUSE_ADDR`), and starts a
replica again under the same id whenever it exits, as a cloud autoscaler brings lost capacity
back. It runs until it is killed together with its process session, replicas included.

How the run maps to torchft's concepts:

* Replica group: each replica process is a replica group of one rank, with its own TCPStore
  and torchft `Manager` (whose ManagerServer heartbeats to the Lighthouse). Replica ids are
  `goodput_tft_<R>`; the Manager appends a fresh uuid, so a restarted replica is a new member.
* Quorum: `OptimizerWrapper.zero_grad()` asks the Lighthouse for the step's quorum in the
  background, overlapping the forward pass. A kill fails the survivors' allreduce, so they do
  not commit that step and retry it in a new quorum without the dead replica. A survivor whose
  allreduce is still hanging (its ring neighbours were alive) may be left out of that quorum
  and, one step behind when it comes back, heals as a restarted replica does.
* Data parallelism: torchft's `DistributedDataParallel` averages gradients over the
  `ProcessGroupGloo` of the quorum's participants (reconfigured on every quorum change). Its
  comm hook in torchft 0.2.0 fails an assertion when the allreduce fails (a peer died mid-step),
  which crashes every survivor; `_DistributedDataParallel` replaces the hook with one that
  leaves the error to the Manager, as torchft intends: the step does not commit.
* Recovery: a restarted replica joins the quorum at step 0, behind the others, so torchft
  heals it: a peer sends it the model and optimizer state through the `state_dict` callback
  (over the process group, `PGTransport`, as torchft's train_ddp.py does) and it loads it with
  `load_state_dict`. It trains no samples of the step it heals in (its gradients are zeroed)
  but commits it with the others, and takes its share from the next step on.
* Commit: `OptimizerWrapper.step()` steps the optimizer only if `manager.should_commit()`,
  which then advances `manager.current_step()`: a step committed when that counter moved.

Every step's 128 samples are a seeded permutation of the data set per epoch; replica R trains
the contiguous slice [R*32, (R+1)*32) of it whether or not the others participate. The
participant of participating rank 0 (the participating replica with the lowest replica id, never
one that heals) records each step the quorum committed, as the other systems' rank 0 does, under
the step's index (0-based, torchft's `current_step()` before the commit), with samples =
participants * 32, and the probe loss every PROBE_EVERY steps. A step in which a replica heals
counts its share though it trained none: 32 samples per recovery, in torchft's favour.
"""

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from benchmarks import goodput_loop as loop

# The Lighthouse forms a quorum from two replicas, and a step commits with two or more.
MIN_REPLICAS = 2
# After a kill the Lighthouse counts the dead replica as alive until its heartbeats (every
# 100 ms) have stopped for HEARTBEAT_TIMEOUT_MS (torchft's default, 5 s, would idle the
# survivors that long), and until then holds back any quorum of half the live replicas or
# fewer, against split brain. A quorum that leaves out a live replica (one still stuck in the
# failed allreduce, say) waits JOIN_TIMEOUT_MS for it: long enough that a replica a little late
# to a step under CPU contention is not dropped, which would make it heal.
HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 1000
# torchft's train_ddp.py's timeouts on CPU: Gloo collectives, checkpoint transfers, and every
# other Manager operation.
PG_TIMEOUT = timedelta(seconds=5)
CHECKPOINT_TIMEOUT = timedelta(seconds=10)
MANAGER_TIMEOUT = timedelta(seconds=30)
POLL_S = 0.1
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# torchft is imported inside the functions below: its first import reads RUST_LOG, which
# main() sets.


def main(out_dir: str) -> None:
    """Run the Lighthouse and WORKERS replicas, restarting each replica that exits; never returns."""
    # torchft's Rust side logs every quorum request at INFO; the replicas inherit this.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    os.makedirs(out_dir, exist_ok=True)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=MIN_REPLICAS,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    # address() names the machine's hostname; the server listens on loopback only.
    lighthouse_addr = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    env = dict(
        os.environ,
        # One thread per replica: four of them share the machine's cores.
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
    )

    def start(replica: int) -> subprocess.Popen:
        # Replicas stay in the supervisor's process session, so killing the session ends the run.
        return subprocess.Popen(
            [sys.executable, "-m", "benchmarks.goodput_torchft", "--replica", str(replica), out_dir,
             lighthouse_addr],
            cwd=REPO_ROOT,
            env=env,
        )

    procs = [start(replica) for replica in range(loop.WORKERS)]
    while True:
        time.sleep(POLL_S)
        for replica, proc in enumerate(procs):
            if proc.poll() is not None:
                print(
                    f"goodput_torchft: replica {replica} (pid {proc.pid}) exited with "
                    f"{proc.returncode}; restarting",
                    file=sys.stderr,
                    flush=True,
                )
                procs[replica] = start(replica)


def _ddp_class() -> type:
    """torchft's DistributedDataParallel with a comm hook that survives a failed allreduce."""
    from torchft import DistributedDataParallel

    class _DistributedDataParallel(DistributedDataParallel):
        # DDP checks these annotations at run time: this module must not postpone them (no
        # `from __future__ import annotations`).
        @staticmethod
        def _comm_hook(manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            work = manager.allreduce(bucket.buffer())
            # wait() returns False after reporting a failure to the Manager, which then refuses
            # to commit the step; torchft's own hook asserts here that the future was set.
            ok = work.wait()
            # A managed work's future chain is lazy: hand DDP the real future underneath it.
            # A work the Manager skipped (it had already errored) has a plain, finished one.
            fut = work.get_future()
            fut = getattr(fut, "_fut", fut)
            if ok and fut is not None:
                return fut
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return _DistributedDataParallel


def replica_main(replica: int, out_dir: str, lighthouse_addr: str) -> None:
    """Train as replica group `replica` until killed, recording every committed step."""
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    torch.set_num_threads(1)
    inputs, labels = loop.make_data()
    model = loop.make_model()

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    # The replica group's own store, which the Manager and the quorum's process group meet in;
    # a launcher such as torchrun would provide it (MASTER_ADDR/MASTER_PORT).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=PG_TIMEOUT)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=MIN_REPLICAS,
        timeout=MANAGER_TIMEOUT,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"goodput_tft_{replica}",
        hostname="127.0.0.1",
        checkpoint_transport=PGTransport(pg, CHECKPOINT_TIMEOUT, torch.device("cpu")),
    )
    ddp_model = _ddp_class()(manager, model)
    optimizer = Optimizer(manager, torch.optim.SGD(ddp_model.parameters(), lr=loop.LR))

    loop.announce(out_dir)
    while True:
        # Every participant's counter is the quorum's step; only a replica about to heal lags, and
        # its slice does not count (torchft zeroes its gradients).
        indices = torch.tensor_split(loop.step_samples(manager.current_step()), loop.WORKERS)[replica]
        optimizer.zero_grad()
        loss = loop.loss_of(ddp_model, inputs[indices], labels[indices])
        loss.backward()
        # Wait for the quorum (done by now, unless the allreduce errored) so that a healing
        # replica's counter is the quorum's step too.
        participants = manager.num_participants()
        step = manager.current_step()
        first = manager.participating_rank() == 0
        optimizer.step()
        if manager.current_step() > step and first:
            probe = loop.probe_loss(model, inputs, labels) if step % loop.PROBE_EVERY == 0 else None
            loop.record(out_dir, step, participants * loop.SHARE, probe)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out_dir")
    parser.add_argument("lighthouse", nargs="?", help="the Lighthouse's address (with --replica)")
    parser.add_argument("--replica", type=int, help="run the replica of this id, not the supervisor")
    args = parser.parse_args()
    if args.replica is None:
        main(args.out_dir)
    else:
        replica_main(args.replica, args.out_dir, args.lighthouse)
