"""Gradient compression: DDP's gradient buckets sent in fp16 or bf16, and the bytes counted.

torch's `fp16_compress_hook` does the same for fp16, but DDP refuses the stock
`bf16_compress_hook` off CUDA by its name, so both are ours: each bucket is cast down, divided
by the world size (before the sum, so fp16 does not overflow), all-reduced, and cast back
into the bucket. Nothing is kept between steps, so a heal or a grow has no compression state
to carry; the hook is registered on every generation's DDP. `elastic.techniques.powersgd` is the
compression that keeps state.

`bytes_sent` counts what each rank hands to the all-reduce per bucket: the payload, not
gloo's ring traffic, which is the same multiple of it at every dtype.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from elastic.config import Strategy
from elastic.techniques.technique import Codec, Run

DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class GradientCompression(Codec):
    """One worker's gradient compression, for every generation of the run; under 'none', DDP's
    buckets as they are, through the hook where the run needs one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = DTYPES[name]
        self.bytes_sent = 0
        self.hooks_gradients = self.dtype is not None

    @classmethod
    def build(cls, strategy: Strategy, run: Run) -> GradientCompression | None:
        kind = strategy.compression_options.kind
        return cls(kind) if kind in DTYPES else None  # PowerSGD is the other codec

    def all_reduce(self, bucket: dist.GradBucket,
                   reduce: Callable[[torch.Tensor], torch.futures.Future]) -> torch.futures.Future:
        buffer = bucket.buffer()
        world_size = dist.get_world_size()
        if self.dtype is None:
            self.bytes_sent += _nbytes(buffer)
            return reduce(buffer.div_(world_size))
        compressed = buffer.to(self.dtype).div_(world_size)
        self.bytes_sent += _nbytes(compressed)
        return reduce(compressed).then(lambda done: buffer.copy_(done.value()))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
