"""The worker actor: one process that runs the user's train loop and joins generations.

`run` occupies the "train" concurrency group for the whole run, so the controller's calls
(prepare, offer or abort a generation, read_probe, ping) are answered by the "control" group
while training goes on. The worker pushes what the controller must learn (ready to join, its
group broke, a generation formed) as one-way calls. The controller keeps the `run` call
outstanding: if this process dies, the controller learns it from that call at once.
"""

from __future__ import annotations

import inspect
import os
import socket
import threading
import time
import traceback
from typing import Any, Callable

import psutil
import ray
import torch

from elastic.checkpoint.checkpoint import CheckpointWriter
from elastic.checkpoint.storage import RunStorage
from elastic.comm.binding import bind_collectives_to, separate_ranks_sharing_a_gpu
from elastic.comm.generation import peer_failed
from elastic.comm.group import GenerationSpec
from elastic.config import CheckpointConfig, DataConfig, Strategy
from elastic.controller.tally import LINK_MIN_BYTES
from elastic.errors import WorkerEvictedError
from elastic.faults import Fault
from elastic.parallel.replicas import ReplicaShape
from elastic.worker.context import TrainContext, _set_current
from elastic.worker.mailbox import GenerationMailbox
from elastic.worker.logs import record_rank
from elastic.worker.reports import REPORT_INTERVAL_S, ReportQueue, ReportSender

# `with step` and ctx.between_steps() heal a peer's death; one that reaches here came from a
# collective the train loop called outside both.
PEER_FAILURE_OUTSIDE_STEP = (
    " (a peer failed during a collective the train loop called outside `with step`; wrap such collectives, "
    "e.g. an evaluation, in `with ctx.between_steps() as block:` to heal instead, and run the block again "
    "while block.failed is set)"
)


NO_STEPS = ("the train loop returned without iterating ctx.steps(dataset) or a prepared data loader, where "
            "elastic forms the workers' group, syncs and checkpoints: each worker ran it alone, and nothing it "
            "trained counts. Write `for step in ctx.steps(dataset):` and train each step inside `with step:`, or "
            "iterate `elastic.prepare_data_loader(loader)` as in Ray Train (docs/habits.md)")


@ray.remote(concurrency_groups={"train": 1, "control": 4})
class Worker:
    def __init__(
        self,
        worker_id: int,
        controller: Any,
        data_config: DataConfig,
        checkpoint_config: CheckpointConfig,
        storage: RunStorage,
        faults: list[Fault],
        use_gpu: bool,
        num_cpus: float,
        strategy: Strategy,
        shape: ReplicaShape,
        slot: int,
        max_workers: int,
        attempt: str = "",
        straggler_check: bool = False,
    ) -> None:
        torch.set_num_threads(max(1, int(num_cpus)))
        self.worker_id = worker_id
        self._controller = controller
        # Without the straggler check only replica 0's reports reach the controller (elastic.worker.reports).
        self._reports = ReportQueue(every_rank=straggler_check, replica_size=shape.size)
        # The run's last flush waits for every one-way call to the controller (ReportSender).
        self._sender = sender = ReportSender(self._reports, lambda items: controller.ingest.remote(worker_id, items))
        self.mailbox = GenerationMailbox(
            on_waiting=lambda: sender.track(controller.worker_ready.remote(worker_id, self.info())),
            on_broken=lambda g: sender.track(controller.group_broken.remote(worker_id, g)),
            on_formed=lambda g, outcome: sender.track(controller.formed.remote(worker_id, g, outcome)),
        )
        # Both calls block their (background or dying) caller until the controller has the news.
        writer = CheckpointWriter(storage, on_written=lambda report: ray.get(controller.shard_written.remote(worker_id, report)),
                                  attempt=attempt)
        # Where it writes checkpoints, the run folder must be the controller's, seen from this node.
        self._check_storage = (lambda: storage.check_shared(attempt, ray.get_runtime_context().get_node_id())
                               ) if checkpoint_config.enabled else (lambda: None)
        self.ctx = TrainContext(
            data_config, self.mailbox, faults, self._reports.add, use_gpu, checkpoint_config, writer,
            on_fault=self._on_fault, strategy=strategy, shape=shape, slot=slot,
            latest_checkpoint=lambda: ray.get(controller.latest_checkpoint_of_run.remote()),
            # Waits (once per kind), so the controller has it before it sees the run's outcome.
            warn=lambda kind, message: ray.get(controller.warn.remote(worker_id, kind, message)),
            max_workers=max_workers,
        )
        record_rank(lambda: self.ctx.rank)
        self.binds = ""  # set when the run starts (elastic.comm.binding)
        self.address = ""  # this node's, which its peers' connections see
        self._straggler_check = straggler_check  # it reads every rank's compute and links (find_slow_link)
        self._stop = threading.Event()
        threading.Thread(target=self._flush_loop, daemon=True, name="elastic-reports").start()

    @ray.method(concurrency_group="train")
    def run(self, train_loop: Callable, config: dict[str, Any]) -> dict[str, Any]:
        """Run the train loop to its end; returns an outcome instead of raising user errors."""
        _set_current(self.ctx)
        try:
            self.address = ray.util.get_node_ip_address()
            unusable = self._check_storage()
            if unusable is not None:
                ray.get(self._controller.warn.remote(self.worker_id, "storage_unusable", unusable))
            self.binds = bind_collectives_to(self.address)
            shared = separate_ranks_sharing_a_gpu(self.worker_id,
                                                  ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0))
            if shared is not None:
                ray.get(self._controller.warn.remote(self.worker_id, "shared_gpu", shared))
            takes_config = len(inspect.signature(train_loop).parameters) > 0
            value = train_loop(config) if takes_config else train_loop()
            self.ctx.end_loop()
            if not self.ctx.entered_steps:
                return {"outcome": "app_error", "rank": self.ctx.rank, "traceback": "", "error": NO_STEPS}
            return {"outcome": "finished", "step": self.ctx.step, "value": _picklable(value),
                    "model": self.ctx.final_model}
        except WorkerEvictedError as exc:
            return {"outcome": "evicted", "reason": str(exc)}
        except Exception as exc:
            hint = PEER_FAILURE_OUTSIDE_STEP if peer_failed(exc) else ""
            return {
                "outcome": "app_error",
                "rank": self.ctx.rank,
                "error": f"{type(exc).__name__}: {exc}{hint}",
                "traceback": traceback.format_exc(),
            }
        finally:
            # Waits, so the controller has the reports it gets before it sees the outcome.
            self._flush(final=True)
            _set_current(None)

    def _on_fault(self, fault: Fault) -> None:
        """Record a fault with the controller before it acts, and do what needs Ray's view of the node."""
        note = ""
        if fault.kind == "node-loss" and _on_head_node():
            note = "refused on the head node (it would end the cluster); only this worker dies"
        ray.get(self._controller.fault_fired.remote(self.worker_id, fault.spec(), self.ctx.step, note))
        if fault.kind == "node-loss" and not note:
            # A worker is a child of its node's raylet: the node is lost when the raylet and
            # every process it started die at once, as when a machine goes away.
            raylet = psutil.Process(os.getppid())
            for process in raylet.children(recursive=True):
                if process.pid != os.getpid():
                    process.kill()
            raylet.kill()

    @ray.method(concurrency_group="control")
    def read_probe(self) -> dict[str, Any]:
        """Where the train thread is, and what the kernel says of its generation's links: the
        controller polls this while no step commits (a hang, an unreachable or a cut-off member)."""
        current = self.ctx.links
        silent = current[1].health().silent if current is not None else {}
        return {**self.ctx.probe_reading(), "address": self.address, "silent": silent}

    @ray.method(concurrency_group="control")
    def info(self) -> dict[str, Any]:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "binds": self.binds,
            "step": self.ctx.step,
            "generation": self.ctx.generation,
        }

    @ray.method(concurrency_group="control")
    def prepare(self, generation: int) -> int:
        """Phase one of a planned switch: the step this rank is at (see elastic.worker.mailbox)."""
        self.ctx.faults.at("prepare", self.ctx.rank, self.ctx.step)
        return self.mailbox.prepare(generation)

    @ray.method(concurrency_group="control")
    def offer(self, spec: GenerationSpec) -> None:
        self.mailbox.offer(spec)
        if spec.switch_step is None:
            # An unplanned switch means a member is gone, and the train thread may wait for it
            # in a collective (an NCCL kernel, or a gloo all-reduce that only the dead rank's
            # neighbours see fail at once): aborting the old group's collectives frees it.
            self.ctx.abort_stale_group(spec.generation)

    @ray.method(concurrency_group="control")
    def abort(self, generation: int) -> None:
        self.mailbox.abort(generation)

    @ray.method(concurrency_group="control")
    def evict(self, reason: str) -> None:
        self.mailbox.close(reason)

    def _flush_loop(self) -> None:
        while not self._stop.wait(REPORT_INTERVAL_S):
            self._flush()

    def _flush(self, final: bool = False) -> None:
        """Send the reports due; `final` sends all and waits until the controller has every report
        this worker sent (`ReportSender`)."""
        self._sender.flush(self.ctx.rank, self.ctx.world_size, time.time(), final,
                           self._links_sample if self._straggler_check else lambda: None)

    def _links_sample(self) -> dict[str, Any] | None:
        """What this generation's connections sent each peer so far, for the controller's check of
        a slow link (`elastic.controller.policies.find_slow_link`): read from the kernel, off the train thread."""
        current = self.ctx.links
        if current is None:
            return None
        generation, links = current
        sent = {peer: traffic for peer, traffic in links.traffic().items() if traffic[0] >= LINK_MIN_BYTES}
        if not sent:
            return None
        return {"kind": "links", "generation": generation, "step": self.ctx.step, "address": self.address,
                "sent": sent}


def _on_head_node() -> bool:
    here = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == here and "node:__internal_head__" in n["Resources"] for n in ray.nodes())


def _picklable(value: Any) -> Any:
    """Train loops may return anything; only what Ray can ship back is kept."""
    try:
        ray.cloudpickle.dumps(value)
        return value
    except Exception:
        return repr(value)
