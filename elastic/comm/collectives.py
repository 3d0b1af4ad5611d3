"""The collectives a train loop calls itself, bound to the generation it runs in.

`ctx.collectives` is rebuilt for each generation. A peer that dies inside one of these calls
makes it raise a peer failure, which `with step:` (or `ctx.between_steps()`, for calls outside
a step) turns into a heal like any other; uncaught, it fails the train loop. A call on the
object of a generation that was left raises instead of reaching the new group.

A SUM changes meaning when the world size does, so every reduction also comes as a mean:
`op="mean"` over ranks, and `sample_mean` over the samples each rank saw, which is what a
metric of the global batch is at any world size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from elastic.errors import ElasticError

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


class Collectives:
    """Collectives over generation `generation`'s group, as long as this rank is in it."""

    def __init__(self, generation: int, current: Callable[[], int]) -> None:
        self.generation = generation
        self._current = current

    @property
    def world_size(self) -> int:
        self._check()
        return dist.get_world_size()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` in place across ranks with op sum, mean, max, min or product; returns it."""
        self._check()
        if op not in _OPS:
            raise ElasticError(f"all_reduce op {op!r} is not one of {sorted(_OPS)}")
        dist.all_reduce(tensor, op=_OPS[op])
        if op == "mean":
            tensor.div_(dist.get_world_size())
        return tensor

    def sample_mean(self, value: torch.Tensor, samples: int) -> torch.Tensor:
        """The mean over every rank's samples of a per-sample mean `value` this rank took over
        `samples` samples (a step's share can differ by one sample between ranks)."""
        self._check()
        weighted = torch.cat([value.detach().reshape(-1).double() * samples,
                              torch.tensor([float(samples)], dtype=torch.float64, device=value.device)])
        dist.all_reduce(weighted)
        return (weighted[:-1] / weighted[-1]).to(value.dtype).reshape(value.shape)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (the same shape on every rank), in rank order."""
        self._check()
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        return gathered

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `tensor`, copied in place into every rank's; returns it."""
        self._check()
        dist.broadcast(tensor, src=src)
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across ranks and return this rank's equal part of dimension 0."""
        self._check()
        world_size = dist.get_world_size()
        if op not in ("sum", "mean") or tensor.shape[0] % world_size:
            raise ElasticError(f"reduce_scatter takes op 'sum' or 'mean' and a first dimension divisible by the "
                               f"world size; got op {op!r} and shape {tuple(tensor.shape)} at world size {world_size}")
        out = torch.empty((tensor.shape[0] // world_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.reduce_scatter_tensor(out, tensor.contiguous())
        return out.div_(world_size) if op == "mean" else out

    def all_to_all(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send `tensors[i]` to rank i; returns what each rank sent to this one, in rank order.
        Every rank sends tensors of one shape."""
        self._check()
        world_size = dist.get_world_size()
        if len(tensors) != world_size:
            raise ElasticError(f"all_to_all takes one tensor per rank: {len(tensors)} given at world size {world_size}")
        received = [torch.empty_like(t) for t in tensors]
        dist.all_to_all(received, [t.contiguous() for t in tensors])
        return received

    def _check(self) -> None:
        current = self._current()
        if current != self.generation:
            raise ElasticError(f"these collectives belong to generation {self.generation}, which this rank left for "
                               f"{current}; use ctx.collectives again inside the step")
