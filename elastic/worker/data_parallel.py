"""Data parallelism: the prepared models of runs whose every rank holds one copy of the model.

`DataParallelModel` is plain DDP, and ZeRO-1 and local SGD, which keep the plain module (ZeRO-1
shards only the optimizer, local SGD syncs parameters instead of gradients): each generation
wraps the module in a new `DistributedDataParallel` whose gradient all-reduce averages the step.
`ShardedModel` is ZeRO-2/3: FSDP2 (`elastic.techniques.fsdp`) shards the parameters anew in
each generation, and the train loop's model holds that generation's module. Both are
`PreparedModel`s (`elastic.parallel.prepared`); the train loop holds their `ElasticDDP`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from elastic.comm.generation import peer_failed
from elastic.comm.state_sync import RunState
from elastic.parallel.prepared import DTENSOR, ComputeFrames, Generation, WorkerPlace, PreparedModel
from elastic.techniques.strategy import Techniques
from elastic.worker.phases import phase

# DDP's gradient bucket size on gloo, in MB. Each bucket's all-reduce starts once the backward
# filled it; on a link slower than compute, torch's 25 MB default holds the first large
# all-reduce back until most of the backward is done. Measured over a 1 Gbit/s link (2 nodes,
# 42 MB of gradients, plain torch DDP, benchmarks/ddp_probe.py): 535 ms a step at 25 MB, 488 at
# 8, 492 at 4, 501 at 2.
# PowerSGD keeps torch's default: it sends two factors per bucket, each a small all-reduce
# whose cost is mostly latency, so fewer buckets send fewer (4 MB is not measured for it).
GLOO_BUCKET_CAP_MB = 4


class ElasticDDP(torch.nn.Module):
    """The prepared model, a `torch.nn.Module` holding yours as `module` (so `parameters()`,
    `state_dict()` with "module." keys, `train()`/`eval()` and `torch.compile` work as on DDP).

    While a generation is formed, calls go to the DistributedDataParallel rebuilt for it (to
    the module itself under local SGD, which syncs parameters, not gradients); before the
    first generation, and between leaving one and forming the next, straight to the module,
    as an evaluation before training needs. Always under the run's autocast.
    """

    def __init__(self, techniques: Techniques, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self._techniques = techniques
        self.ddp: DistributedDataParallel | None = None
        # Ray Train's loop shape sets it: a peer's failure in DDP's forward is kept on the step
        # (`TrainContext._keep_failure_on_step`), as one in the backward's all-reduce is.
        self.forward_failed: Callable[[str], None] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # DDP holds `module`: registered as a submodule, it would appear twice in state_dict().
        if name == "ddp":
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def forward(self, *args, **kwargs):
        with phase("elastic.forward"):
            if self.ddp is None:
                return self._techniques.precision.forward(self.module, *args, **kwargs)
            try:
                return self._techniques.precision.forward(self.ddp, *args, **kwargs)
            except Exception as exc:
                if self.forward_failed is None or not peer_failed(exc):
                    raise
                # DDP's forward broadcasts the module's buffers (BatchNorm's running statistics)
                # from rank 0, and a dead peer fails that broadcast. The loop goes on with this
                # rank's own buffers; the step is failed, does not commit, and the next batch heals.
                self.forward_failed(f"{type(exc).__name__}: {exc}")
                return self._techniques.precision.forward(self.module, *args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)  # the user's own attributes, as before wrapping


class DataParallelModel(PreparedModel):
    """One whole copy of the model per rank, its gradients averaged by DDP (none yet before prepare_model)."""

    def __init__(self, place: WorkerPlace, techniques: Techniques, model: torch.nn.Module | None,
                 state: RunState) -> None:
        self._techniques = techniques
        self._device = place.device
        self._inside: torch.utils.hooks.RemovableHandle | None = None  # the faults' hook in this generation
        self._syncing = True  # the backward under way syncs the gradients (its micro-batch is the step's last)
        if model is not None:
            model.to(place.device)
            self.returned = ElasticDDP(techniques, model)
            state.model = model
            techniques.prepare_model(model, state)

    def start(self, generation: Generation) -> bool:
        if self.returned is None:
            return False
        if self._techniques.replaces_ddp:
            self.returned.ddp = None  # local SGD: no gradient all-reduce
            return False
        cuda = self._device.type == "cuda"
        bucket_cap = {} if cuda or self._techniques.keeps_torch_buckets else {"bucket_cap_mb": GLOO_BUCKET_CAP_MB}
        # Under overlap_optimizer a bucket's parameters step as its all-reduce lands: their gradients
        # must be views of the bucket, not filled from it after the last bucket.
        ddp = DistributedDataParallel(self.returned.module, device_ids=[self._device.index] if cuda else None,
                                      init_sync=False, gradient_as_bucket_view=self._techniques.steps_on_bucket_views,
                                      **bucket_cap)
        if generation.comm_hook is not None:
            ddp.register_comm_hook(*generation.comm_hook)
        self.returned.ddp = ddp
        if generation.inside_all_reduce is not None:
            self._inside = _hook_inside_all_reduce(self.returned.module, generation.inside_all_reduce,
                                                   lambda: self._syncing)
        return generation.comm_hook is not None

    def unbind(self) -> list[Any]:
        if self.returned is not None:
            self.returned.ddp = None
        if self._inside is not None:
            self._inside.remove()
            self._inside = None
        return []

    def accumulating(self, last: bool) -> AbstractContextManager:
        self._syncing = last
        ddp = self.returned.ddp if self.returned is not None else None
        return ddp.no_sync() if ddp is not None and not last else nullcontext()

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: _whole(tensor) for name, tensor in self.returned.module.state_dict().items()}


class ShardedModel(DataParallelModel):
    """ZeRO-2/3: the module is sharded by FSDP2 in each generation, which syncs the gradients itself."""

    compute_frames = ComputeFrames((DTENSOR,))  # its parameters are DTensors

    def __init__(self, place: WorkerPlace, techniques: Techniques, model: torch.nn.Module,
                 state: RunState) -> None:
        super().__init__(place, techniques, model, state)
        # Each generation's FSDP2 module replaces the last one as the prepared model's `module`.
        self._techniques.on_module_rebuilt(lambda module: setattr(self.returned, "module", module))

    def accumulating(self, last: bool) -> AbstractContextManager:
        self._techniques.set_gradient_sync(last)
        return super().accumulating(last)


def _hook_inside_all_reduce(module: torch.nn.Module, call: Callable[[], None],
                            syncing: Callable[[], bool]) -> torch.utils.hooks.RemovableHandle | None:
    """Call `call` inside DDP's gradient all-reduce of each syncing backward, on DDP's own path: once
    the gradient of the module's first parameter accumulated, usually the backward's last, when
    DDP launched every bucket but the one holding it (a tensor's hook runs before DDP's, which
    marks the parameter ready). A rank that dies or hangs there never completes the all-reduce its
    peers wait in."""
    first = next((p for p in module.parameters() if p.requires_grad), None)
    if first is None:
        return None
    return first.register_post_accumulate_grad_hook(lambda _: call() if syncing() else None)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a state dict's tensor, gathered whole if it is a shard (a DTensor of ZeRO-2/3)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()  # a collective over the tensor's mesh
    return tensor.detach().to("cpu", copy=True)
