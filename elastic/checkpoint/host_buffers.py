"""Host buffers for checkpoint snapshots, allocated once and reused while their sizes hold.

A snapshot copies the state into one flat host buffer per dtype (`take_snapshot`). A buffer
allocated afresh for each checkpoint costs the kernel a page fault per 4 KB page as the copy
first touches it; from a GPU, a copy into ordinary (pageable) memory also goes through a bounce
buffer at about a fortieth of what the link carries. `HostBuffers` keeps the buffers a written
snapshot gave back and hands them to the next snapshot of the same sizes: already touched, and
page-locked (pinned) when the state lives on a GPU, so the copy runs at the link's speed.

A snapshot holds its buffers until the writer has written it or skipped it, and then gives them
back (`Snapshot.release`); at most the snapshot uploading, the one waiting and the one being
taken hold buffers at once (`CheckpointWriter`), so the pool holds at most three sets.
"""

from __future__ import annotations

import threading

import torch


class HostBuffers:
    """Free host buffers by (dtype, elements, pinned), taken by snapshots and given back after their write."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int, bool], list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # the train thread takes, the writer's thread gives back

    def take(self, dtype: torch.dtype, numel: int, pinned: bool) -> torch.Tensor:
        """A 1-d host buffer of `numel` elements of `dtype`: a given-back one of that size, else a new one."""
        with self._lock:
            free = self._free.get((dtype, numel, pinned))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                self._free.setdefault((buffer.dtype, buffer.numel(), buffer.is_pinned()), []).append(buffer)

    def clear(self) -> None:
        """Let go of every free buffer (the state's sizes changed for good: a rescale of a sharded state)."""
        with self._lock:
            self._free.clear()
