"""Healing state sync: the most advanced rank broadcasts its state to every other rank.

After a generation forms, the ranks all-gather how many steps each has committed. The rank
furthest ahead (the lowest such rank on a tie) is the source. It sends the structure of its
state (without tensor data) as one small object, then the tensor data as one flat buffer per
dtype, which every other rank loads in place. A newcomer (step 0) therefore receives the
model, optimizer and data cursor of the live ranks; a survivor that missed the last step
catches up; nobody reads storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SyncResult:
    source_rank: int
    step: int
    steps_before: list[int]


@dataclass(frozen=True)
class _TensorRef:
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    offset: int


def sync_state(objects: dict[str, Any], progress: dict[str, Any], device: torch.device) -> tuple[SyncResult, dict[str, Any]]:
    """Make every rank hold the state of the most advanced one.

    `objects` maps names to things with `state_dict`/`load_state_dict`, or to tensors.
    `progress` holds plain values and must contain "step". Returns the sync result and the
    progress every rank now shares.
    """
    world_size = dist.get_world_size()
    mine = torch.tensor([progress["step"]], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    steps = [int(t.item()) for t in gathered]
    source = steps.index(max(steps))
    result = SyncResult(source_rank=source, step=steps[source], steps_before=steps)
    if world_size == 1:
        return result, progress

    is_source = dist.get_rank() == source
    payload = {"progress": progress, "state": {k: _state_of(v) for k, v in objects.items()}} if is_source else None
    structure, buffers = _flatten(payload, device) if is_source else (None, {})
    box = [structure]
    dist.broadcast_object_list(box, src=source, device=device)
    structure = box[0]
    for dtype, size in structure["buffer_sizes"].items():
        buffer = buffers[dtype] if is_source else torch.empty(size, dtype=dtype, device=device)
        dist.broadcast(buffer, src=source)
        buffers[dtype] = buffer
    if is_source:
        return result, progress
    received = _unflatten(structure["tree"], buffers)
    for name, obj in objects.items():
        _load_into(obj, received["state"][name])
    return result, received["progress"]


def _state_of(obj: Any) -> Any:
    return obj.detach() if isinstance(obj, torch.Tensor) else obj.state_dict()


def _load_into(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():
            obj.copy_(state)
    else:
        obj.load_state_dict(state)


def _flatten(payload: Any, device: torch.device) -> tuple[dict[str, Any], dict[torch.dtype, torch.Tensor]]:
    pieces: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            flat = value.detach().reshape(-1).to(device)
            ref = _TensorRef(value.dtype, tuple(value.shape), str(value.device), sizes.get(value.dtype, 0))
            pieces.setdefault(value.dtype, []).append(flat)
            sizes[value.dtype] = ref.offset + flat.numel()
            return ref
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    tree = walk(payload)
    buffers = {dtype: torch.cat(parts) for dtype, parts in pieces.items()}
    return {"tree": tree, "buffer_sizes": sizes}, buffers


def _unflatten(tree: Any, buffers: dict[torch.dtype, torch.Tensor]) -> Any:
    if isinstance(tree, _TensorRef):
        count = 1
        for dim in tree.shape:
            count *= dim
        flat = buffers[tree.dtype][tree.offset : tree.offset + count]
        return flat.reshape(tree.shape).to(tree.device).clone()
    if isinstance(tree, dict):
        return {k: _unflatten(v, buffers) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unflatten(v, buffers) for v in tree)
    return tree
