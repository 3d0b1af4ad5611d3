"""A nested state (dicts, lists, tensors, plain values) as one structure plus flat buffers.

Both healing and checkpoints move state this way: one buffer per dtype instead of hundreds
of small tensors. The structure holds only plain values and tensor references, so it
travels as a small object and loads with `torch.load(weights_only=True)`.

`describe` lays the tensors out without copying anything; `gather` then copies any range of a
dtype's buffer, each tensor's part once, into a buffer allocated for that range. A checkpoint
uses this to copy only the slice its rank writes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_REF = "__elastic_tensor__"


def flatten(payload: Any, device: torch.device) -> tuple[Any, dict[str, torch.Tensor]]:
    """(structure, {dtype name: 1-d buffer on `device`}); the buffers are copies."""
    structure, tensors = describe(payload)
    return structure, {dtype: gather(parts, 0, numel(parts), device) for dtype, parts in tensors.items()}


def describe(payload: Any) -> tuple[Any, dict[str, list[torch.Tensor]]]:
    """(structure, {dtype name: the tensors in buffer order}); nothing is copied."""
    tensors: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            offset = sizes.get(dtype, 0)
            tensors.setdefault(dtype, []).append(value.detach())
            sizes[dtype] = offset + value.numel()
            return {_REF: [dtype, list(value.shape), str(value.device), offset]}
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(payload), tensors


def numel(tensors: list[torch.Tensor]) -> int:
    """Length of the buffer that `tensors` make end to end."""
    return sum(t.numel() for t in tensors)


def gather(tensors: list[torch.Tensor], start: int, stop: int, device: torch.device,
           buffer: torch.Tensor | None = None, non_blocking: bool = False) -> torch.Tensor:
    """Elements [start, stop) of `tensors` laid end to end, in a new 1-d buffer on `device` (or in
    `buffer`, of stop - start elements).

    The buffer is allocated once and each tensor's part is copied straight into it, across
    devices and strides alike: no per-tensor temporary and no second copy by `torch.cat`.
    `non_blocking`: copies from a GPU into a pinned `buffer` are queued on the current stream and
    the host goes on; the caller waits for them (an event recorded after) before reading.
    """
    if buffer is None:
        buffer = torch.empty(stop - start, dtype=tensors[0].dtype, device=device)
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        begin, end = max(start, offset), min(stop, offset + count)
        if begin < end:
            target = buffer[begin - start : end - start]
            if end - begin == count:
                target.view(tensor.shape).copy_(tensor, non_blocking=non_blocking)
            else:
                # Part of a tensor: a view of its flat form (a copy only if it is not contiguous).
                target.copy_(tensor.reshape(-1)[begin - offset : end - offset], non_blocking=non_blocking)
        offset += count
    return buffer


def unflatten(structure: Any, buffers: dict[str, torch.Tensor]) -> Any:
    """The nested state again; every tensor goes back to the device it came from."""
    if isinstance(structure, dict) and _REF in structure:
        dtype, shape, device, offset = structure[_REF]
        count = 1
        for dim in shape:
            count *= dim
        flat = buffers[dtype][offset : offset + count]
        return flat.reshape(shape).to(device).clone()
    if isinstance(structure, dict):
        return {k: unflatten(v, buffers) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(unflatten(v, buffers) for v in structure)
    return structure


def reduce_in_place(tensors: list[torch.Tensor], reduce: Callable[[torch.Tensor], None], *, scale: float = 1.0,
                    divide: float = 1.0) -> None:
    """Reduce `tensors` across ranks with one collective per dtype: each dtype's tensors go into one flat
    buffer, multiplied by `scale`, reduced in place by `reduce`, divided by `divide`, and copied back."""
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        if scale != 1.0:
            flat.mul_(scale)
        reduce(flat)
        if divide != 1.0:
            flat.div_(divide)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def buffer_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
