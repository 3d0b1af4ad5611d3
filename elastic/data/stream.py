"""An `IterableDataset` as a source of steps, exactly once, where its position can be saved.

Every rank iterates the same stream: each step draws the stream's next `global_batch_size`
samples (the epoch's last step what is left, unless `drop_last`), and rank r keeps its
share, so the samples of a step do not depend on the world size, as for map-style data.
The dataset must say where it is: `state_dict()` after a step's samples were drawn,
`load_state_dict()` before it is iterated again (torchdata's `Stateful` protocol). The
position after the last committed step is synced state ("data_stream"): a heal or a grow
puts every rank's stream there, a newcomer's included, and checkpoints keep it. An epoch
ends when the stream does; the next one calls `set_epoch(epoch)` if the dataset has it and
iterates afresh from the dataset's first state.

A micro-batch's `indices` are the samples' positions in the epoch's stream. With
`prefetch_threads` the next step's samples are drawn in a background thread; collating
this rank's share stays on the train thread.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import default_collate

from elastic.config import DataConfig
from elastic.data import order as data_math
from elastic.data.order import Loaded, micro_batches_of
from elastic.errors import ElasticError

Key = tuple[int, int]  # epoch, samples drawn in the epoch


class StreamLoader:
    """Draws each step's samples from an iterable dataset; is itself the synced "data_stream" state."""

    def __init__(self, dataset: Any, config: DataConfig) -> None:
        missing = [name for name in ("state_dict", "load_state_dict") if not callable(getattr(dataset, name, None))]
        if missing:
            raise ElasticError(
                f"{type(dataset).__name__} is an iterable dataset without {' and '.join(m + '()' for m in missing)}: its position "
                "cannot be saved, so a heal could not resume it and samples would be lost or seen twice. Implement "
                "state_dict() and load_state_dict() (torchdata's Stateful protocol), or use a map-style dataset"
            )
        self.dataset = dataset
        self.config = config
        self._initial = copy.deepcopy(dataset.state_dict())
        self._committed: dict[str, Any] = {"epoch": 0, "consumed": 0, "position": None}  # None: the epoch's start
        self._iterator: Any = None
        self._at: Key | None = None  # where the live iterator is
        self._drawn: dict[Key, tuple[Key, list[Any], Any]] = {}  # asked -> (drawn at, samples, position after)
        self._lock = threading.Lock()  # one thread draws at a time
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="elastic-stream") if config.prefetch_threads else None

    # --- what the context asks ---------------------------------------------------------------
    def settle(self, cursor: data_math.DataCursor) -> data_math.DataCursor:
        """The cursor of the step that really starts at `cursor`: the next epoch's first when the
        stream ended exactly at `cursor` (or, with drop_last, leaves less than a global batch)."""
        (epoch, consumed), _, _ = self._draw((cursor.epoch, cursor.consumed))
        return data_math.DataCursor(epoch, consumed, cursor.seed)

    def step_samples(self, cursor: data_math.DataCursor) -> int:
        return len(self._draw((cursor.epoch, cursor.consumed))[1])

    def advance(self, cursor: data_math.DataCursor) -> data_math.DataCursor:
        """The cursor after the step at `cursor`, which becomes the committed position."""
        _, samples, position = self._draw((cursor.epoch, cursor.consumed))
        if len(samples) < self.config.global_batch_size:
            after, position = data_math.DataCursor(cursor.epoch + 1, 0, cursor.seed), None
        else:
            after = data_math.DataCursor(cursor.epoch, cursor.consumed + len(samples), cursor.seed)
        with self._lock:
            self._committed = {"epoch": after.epoch, "consumed": after.consumed, "position": copy.deepcopy(position)}
            self._drawn = {k: v for k, v in self._drawn.items() if k >= (after.epoch, after.consumed)}
        return after

    def step(self, cursor: data_math.DataCursor, world_size: int, rank: int) -> list[Loaded]:
        _, samples, _ = self._draw((cursor.epoch, cursor.consumed))
        if self._pool is not None and len(samples) == self.config.global_batch_size:
            self._pool.submit(self._draw_ahead, (cursor.epoch, cursor.consumed + len(samples)))
        start, stop = data_math.share_bounds(len(samples), world_size, rank)
        if start == stop:
            # Fewer samples than ranks: this rank joins the all-reduce with a pass that weighs 0.
            return [Loaded(torch.empty(0, dtype=torch.int64), default_collate(samples[:1]), 0)]
        ids = torch.arange(cursor.consumed + start, cursor.consumed + stop, dtype=torch.int64)
        return micro_batches_of(ids, lambda a, b: default_collate(samples[start + a:start + b]),
                                self.config.micro_batch_size, len(samples), world_size)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- synced state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._committed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._committed = copy.deepcopy(state)
            self._drawn, self._at = {}, None  # what was drawn followed another position

    # --- drawing -----------------------------------------------------------------------------
    def _draw(self, key: Key) -> tuple[Key, list[Any], Any]:
        with self._lock:
            if key not in self._drawn:
                committed = (self._committed["epoch"], self._committed["consumed"])
                # An epoch's start is always reachable: a settled cursor may be synced before the
                # step at it commits, with the position still at the end of the previous epoch.
                if self._at != key and key != committed and not (key[1] == 0 and key[0] > committed[0]):
                    raise ElasticError(f"internal: the stream was asked for {key} while its synced position is "
                                       f"{(self._committed['epoch'], self._committed['consumed'])}")
                drawn = self._draw_locked(key)
                self._drawn[key] = self._drawn[drawn[0]] = drawn  # also under the key it was drawn at
            return self._drawn[key]

    def _draw_ahead(self, key: Key) -> None:
        with self._lock:
            if key not in self._drawn and self._at == key:
                drawn = self._draw_locked(key)
                self._drawn[key] = self._drawn[drawn[0]] = drawn

    def _draw_locked(self, key: Key) -> tuple[Key, list[Any], Any]:
        epoch, consumed = key
        if self._at != key:
            position = self._committed["position"] if self._committed["epoch"] == epoch else None
            self._restart(epoch, position)
        samples = self._next()
        if consumed > 0 and (not samples or (self.config.drop_last and len(samples) < self.config.global_batch_size)):
            epoch, consumed = epoch + 1, 0  # the epoch ended at `key`: this step is the next epoch's first
            self._restart(epoch, None)
            samples = self._next()
        if len(samples) < (self.config.global_batch_size if self.config.drop_last else 1):
            least = (f"global_batch_size({self.config.global_batch_size}), as drop_last needs"
                     if self.config.drop_last else "one sample")
            raise ElasticError(f"{type(self.dataset).__name__} yielded {len(samples)} samples in epoch {epoch}; an "
                               f"iterable dataset must yield at least {least} per epoch")
        self._at = (epoch, consumed + len(samples))
        return (epoch, consumed), samples, copy.deepcopy(self.dataset.state_dict())

    def _restart(self, epoch: int, position: Any) -> None:
        # The position first: a dataset whose state holds its epoch takes the new one after.
        self.dataset.load_state_dict(copy.deepcopy(self._initial if position is None else position))
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        self._iterator = iter(self.dataset)

    def _next(self) -> list[Any]:
        samples = []
        for sample in self._iterator:
            samples.append(sample)
            if len(samples) == self.config.global_batch_size:
                break
        return samples
