"""A nested state (dicts, lists, tensors, plain values) as one structure plus flat buffers.

Both healing and checkpoints move state this way: one buffer per dtype instead of hundreds
of small tensors. The structure holds only plain values and tensor references, so it
travels as a small object and loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

from typing import Any

import torch

_REF = "__elastic_tensor__"


def flatten(payload: Any, device: torch.device) -> tuple[Any, dict[str, torch.Tensor]]:
    """(structure, {dtype name: 1-d buffer on `device`}); the buffers are copies."""
    pieces: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            flat = value.detach().reshape(-1).to(device)
            offset = sizes.get(dtype, 0)
            pieces.setdefault(dtype, []).append(flat)
            sizes[dtype] = offset + flat.numel()
            return {_REF: [dtype, list(value.shape), str(value.device), offset]}
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    structure = walk(payload)
    # torch.cat copies even a single piece's worth when given views of live tensors.
    buffers = {dtype: torch.cat(parts) if len(parts) > 1 else parts[0].clone() for dtype, parts in pieces.items()}
    return structure, buffers


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


def buffer_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
