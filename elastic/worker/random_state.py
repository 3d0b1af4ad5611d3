"""The process's random number generators as one piece of synced, checkpointed state.

Registered by every run under the name "rng", like the model: when a generation forms by
sending state (every start, grow and restart, and a heal in which some survivor was behind),
every rank takes the source rank's python, numpy, torch (and, once initialised, CUDA)
generator states; checkpoints keep them; a failed step rewinds them to its start. So a loop
whose ranks draw alike (dropout on equal shares, noise, a schedule's jitter) redraws after a
heal exactly what the fault-free run drew, and a newcomer draws what the others draw.

Like any synced state this assumes the ranks stay alike between formations. Draws that
depend on a rank's share (per-sample augmentation on shares that differ by one) or on its
rank make the generators differ until the next formation, and a checkpoint written then
holds pieces of several ranks' states; seed such draws from (seed, step, rank) with a
`torch.Generator` of their own. Seeding each rank differently at start is overridden by the
first generation.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Any

import torch

try:
    import numpy
except ImportError:  # numpy is optional for torch; without it there is no numpy stream to keep
    numpy = None


class RandomState:
    """state_dict()/load_state_dict() over the global generators, in tensors that sync as a flat
    buffer; `mark()` and `rewind()` put them back to a step's start when the step fails, so a
    redone step draws what the fault-free run drew."""

    def __init__(self) -> None:
        self._mark: tuple | None = None
        self._read_python = PythonState().read  # python's state at a step's start
        # numpy's state at a step's start; get_bit_generator, which the quick read needs, came in numpy 1.25.
        self._read_numpy = (None if numpy is None else NumpyState().read
                            if hasattr(numpy.random, "get_bit_generator") else numpy.random.get_state)

    def mark(self) -> None:
        self._mark = (torch.default_generator.get_state(), self._read_python(),
                      self._read_numpy() if self._read_numpy is not None else None,
                      torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)

    def rewind(self) -> None:
        if self._mark is None:
            return
        torch_state, python_state, numpy_state, cuda_state = self._mark
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": torch.tensor([version, *internal], dtype=torch.int64),
            "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
        }
        if numpy is not None:
            _, keys, position, has_gauss, cached = numpy.random.get_state()
            state["numpy"] = torch.tensor([*keys.tolist(), position, has_gauss], dtype=torch.int64)
            state["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"].cpu())
        python = state["python"].tolist()
        gauss = float(state["python_gauss"][0])
        random.setstate((python[0], tuple(python[1:]), None if gauss != gauss else gauss))
        if numpy is not None and "numpy" in state:
            values = state["numpy"].tolist()
            keys = numpy.array(values[:-2], dtype=numpy.uint32)
            numpy.random.set_state(("MT19937", keys, values[-2], values[-1], float(state["numpy_gauss"][0])))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"].cpu()))


_PYTHON_STATE_FORMAT = "=i624I"  # CPython's RandomObject after the object header: int index, uint32_t state[624]


class PythonState:
    """python's global generator state (`random.getstate()`), read at every step's start at a
    microsecond's cost while the loop does not draw from it.

    `getstate` builds a tuple of 625 ints, about 9 µs warm and several times that at a step's
    start, cold from the backward. CPython keeps the generator's index and key right after the
    object's header, as raw bytes readable through ctypes in a tenth of a microsecond. When they
    equal the bytes of the last full read, the key is that read's (the gaussian that `gauss`
    caches is an attribute, read each time). The layout is checked once against `getstate`; an
    interpreter where it differs is read in full every time.
    """

    def __init__(self) -> None:
        self._generator = random._inst  # what random.getstate() reads
        self._internal: tuple | None = None
        self._raw: bytes | None = None
        self._raw_view: Any = None
        self._version, internal, _ = self._generator.getstate()
        size = struct.calcsize(_PYTHON_STATE_FORMAT)
        # Only where id() is the object's address and the object is large enough to hold the layout.
        if sys.implementation.name != "cpython" or type(self._generator).__basicsize__ < object.__basicsize__ + size:
            return
        view = (ctypes.c_char * size).from_address(id(self._generator) + object.__basicsize__)
        index, *key = struct.unpack(_PYTHON_STATE_FORMAT, view.raw)
        if internal == (*key, index):
            self._raw_view = view

    def read(self) -> tuple:
        generator = self._generator
        if self._raw_view is None:
            return generator.getstate()
        raw = self._raw_view.raw
        if raw != self._raw:
            internal = generator.getstate()[1]
            # Cached only if no other thread drew between the two reads: the bytes must name the key.
            self._internal, self._raw = internal, (raw if self._raw_view.raw == raw else None)
            return self._version, internal, generator.gauss_next
        return self._version, self._internal, generator.gauss_next


_MT19937_STATE_BYTES = 624 * 4 + ctypes.sizeof(ctypes.c_int)  # numpy's mt19937_state: uint32 key[624], int pos


class NumpyState:
    """numpy's global generator state (`numpy.random.get_state()`), read at every step's start
    at a microsecond's cost while the loop does not draw from it.

    `get_state` copies the 624-word key one word at a time, about 50 µs: the largest part of
    what elastic added to a step. The same key and position are readable as raw bytes through
    the bit generator's ctypes interface in under a microsecond. When they equal the bytes of
    the last full read, and that read held no cached gaussian, the state is that read's: the
    legacy gaussian is only cached by drawing, which moves the key or the position. (Only a
    `set_state` to the same key and position with a cached gaussian would escape this.)
    """

    def __init__(self) -> None:
        self._state: tuple | None = None
        self._raw: bytes | None = None
        self._generator: Any = None  # the global bit generator whose raw state `_address` points at
        self._raw_view: Any = None  # a ctypes char array over its state; None: not an MT19937 of the layout above

    def read(self) -> tuple:
        generator = numpy.random.get_bit_generator()
        if generator is not self._generator:
            self._adopt(generator)
        raw = None if self._raw_view is None else self._raw_view.raw
        if raw is None or raw != self._raw or self._state[3]:  # [3]: has_gauss
            # Legacy's tuple (with has_gauss) only exists for MT19937; others give their dict.
            self._state, self._raw = numpy.random.get_state(legacy=raw is not None), raw
        return self._state

    def _adopt(self, generator: Any) -> None:
        """Check once, against its documented state, that the new global generator has the layout read."""
        self._generator, self._raw_view, self._raw = generator, None, None
        if isinstance(generator, numpy.random.MT19937):
            state = generator.state["state"]
            expected = state["key"].astype(numpy.uint32).tobytes() + numpy.array(state["pos"], numpy.intc).tobytes()
            view = (ctypes.c_char * _MT19937_STATE_BYTES).from_address(generator.ctypes.state_address)
            if view.raw == expected:
                self._raw_view = view
