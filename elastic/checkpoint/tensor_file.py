"""The shard file format: safetensors, the field's format for tensors, so loading runs no code.

A shard holds flat 1-d buffers, one per dtype, each named by its dtype (`float32`, ...), in the
layout of `elastic.comm.flat_state`. The structure that places the buffers' elements in the
nested state, when the file carries it, lies in the header's metadata as `torch.save` bytes in
base64, loaded with `torch.load(weights_only=True)`: it holds only plain values.

`encode` returns the file as pieces that point into the tensors' own memory, so the writer
hands them to storage as they are: nothing is pickled and no byte is copied on the way. A
dtype safetensors has no code for is stored as bytes (U8), and its name says what to view them
as. `decode` reads a file back through the safetensors library itself, so every shard elastic
writes is also a file any safetensors tool opens.
"""

from __future__ import annotations

import base64
import io
import json
import struct
from typing import Any

import safetensors.torch
import torch

SUFFIX = ".safetensors"
_STRUCTURE = "structure"  # the metadata key of the structure
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_HEADER_ALIGN = 8  # safetensors pads its header so that the data starts 8-byte aligned


def encode(buffers: dict[str, list[torch.Tensor]], structure: Any = None,
           metadata: dict[str, str] | None = None) -> list[Any]:
    """The file's bytes, as pieces: the header, then each dtype's tensors end to end (one
    tensor named by the dtype in the file). The pieces share memory with CPU tensors."""
    described = dict(metadata or {})
    if structure is not None:
        serialized = io.BytesIO()
        torch.save(structure, serialized)
        described[_STRUCTURE] = base64.b64encode(serialized.getvalue()).decode()
    header: dict[str, Any] = {"__metadata__": described}
    pieces: list[Any] = [b""]
    offset = 0
    for name, tensors in buffers.items():
        begin = offset
        for tensor in tensors:
            flat = tensor.detach().reshape(-1).contiguous().cpu()
            pieces.append(memoryview(flat.view(torch.uint8).numpy()))
            offset += flat.numel() * flat.element_size()
        dtype = tensors[0].dtype
        code = _CODES.get(dtype, "U8")
        length = (offset - begin) // (1 if code == "U8" else dtype.itemsize)
        header[name] = {"dtype": code, "shape": [length], "data_offsets": [begin, offset]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _HEADER_ALIGN)
    pieces[0] = struct.pack("<Q", len(text)) + text
    return pieces


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], Any]:
    """({dtype name: 1-d buffer}, the structure or None) of a file `encode` wrote."""
    stored = safetensors.torch.load(data)
    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    buffers = {}
    for name, tensor in stored.items():
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"the shard holds a buffer {name!r}, which names no torch dtype")
        buffers[name] = tensor if tensor.dtype == dtype else tensor.view(dtype)
    structure = None
    if _STRUCTURE in metadata:
        structure = torch.load(io.BytesIO(base64.b64decode(metadata[_STRUCTURE])), weights_only=True)
    return buffers, structure
