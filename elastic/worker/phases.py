"""The step's phases as `torch.profiler` ranges, so that a user's own profile shows elastic's share.

    with torch.profiler.profile() as prof:
        for step in ctx.steps(dataset): ...
    # prof.key_averages(): elastic.data, elastic.forward, elastic.backward, elastic.commit

`elastic.data` is the step's share loaded and moved to the device, `elastic.forward` the prepared
model's forward, `elastic.backward` a micro-batch's backward (DDP's gradient all-reduce runs inside
it, under torch's own names), `elastic.commit` the step's end (the cursor's advance, the report).
The optimizer's step shows under torch's own `Optimizer.step#...`. A range costs about 10 µs even
when no profiler runs, so `phase` opens one only while a profiler does (a check of 0.1 µs).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.autograd.profiler import record_function

_NOTHING = nullcontext()
_profiling = torch._C._autograd._profiler_enabled


def phase(name: str) -> AbstractContextManager:
    """A profiler range named `name` while a profiler runs; nothing otherwise."""
    return record_function(name) if _profiling() else _NOTHING
