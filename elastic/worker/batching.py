"""Micro-batching: this worker's share of each global step, cut into what the train loop backpropagates.

The global batch splits across the data-parallel peers (the ranks, or the replicas of a run of
replicas, whose every worker computes on its replica's share), and each share into micro-batches
(`step.micro_batches()`), each weighted by its part of the step's samples so that the step's
gradient is the global batch's mean at any world size; a kind of prepared model that takes the
share as one batch cuts it itself (`step.batch()`). `MicroBatching` owns the run's loader and
checks, before the optimizer steps, that every batch handed out was backpropagated weighted.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from elastic.comm.state_sync import RunState
from elastic.config import DataConfig
from elastic.data import order as data_math
from elastic.data.loader import Loader, open_loader, to_device
from elastic.data.stream import StreamLoader
from elastic.errors import ElasticError, UnweightedBackwardError
from elastic.parallel.prepared import PreparedModel
from elastic.parallel.replicas import ReplicaShape
from elastic.techniques.strategy import Techniques
from elastic.worker.injection import FaultInjector
from elastic.worker.phases import phase
from elastic.worker.probe import HangProbe
from elastic.worker.step import MicroBatch, Step


class MicroBatching:
    """The run's loader, and each step's share of it in (micro-)batches: the `StepBatches` a `Step` takes them from."""

    def __init__(self, data_config: DataConfig, shape: ReplicaShape, device: torch.device, faults: FaultInjector,
                 techniques: Techniques, probe: HangProbe, model: Callable[[], PreparedModel]) -> None:
        self._data_config = data_config
        self._shape = shape
        self._device = device
        self._faults = faults
        self._techniques = techniques
        self._probe = probe
        self._model = model
        self.loader: Loader | StreamLoader | None = None
        self._where = (-1, 0, 0)  # (generation, data-parallel peers, this worker's replica): see `_peers`

    def whole_shares(self, data_config: DataConfig) -> None:
        """Serve each step's share of `data_config`'s global batch as one micro-batch, whatever the
        world size (Ray Train's loop shape, where each batch of the loop is a whole step)."""
        self._data_config = data_config.model_copy(update={"micro_batch_size": data_config.global_batch_size})

    def open(self, dataset: Any, state: RunState) -> Loader | StreamLoader:
        if self._data_config.micro_batch_size is None:  # DataConfig's default: the whole share in one pass
            self.whole_shares(self._data_config)
        self.loader = open_loader(dataset, self._data_config, pin_memory=self._device.type == "cuda")
        if self._model().needs_full_steps and isinstance(self.loader, Loader):
            self._check_full_steps(self.loader.num_samples)
        if isinstance(self.loader, StreamLoader):
            state.data_stream = self.loader  # its position is synced and checkpointed
        return self.loader

    def _check_full_steps(self, samples: int) -> None:
        """A kind that cuts its share into equal micro-batches itself refuses a dataset with a short step."""
        global_batch = self._data_config.global_batch_size
        if not self._data_config.drop_last and samples % global_batch:
            raise ElasticError(
                f"the dataset has {samples} samples, so each epoch ends with a step of {samples % global_batch}, short "
                f"of global_batch_size({global_batch}), which the replicas cannot cut into equal micro-batches: set "
                "DataConfig(drop_last=True), or give a dataset of a multiple of global_batch_size samples")

    def _peers(self, step: Step) -> tuple[int, int]:
        """(the data-parallel peers, this worker's replica among them) in `step`'s generation: worked
        out once a generation, from the run's shape and the generation's rank and world size."""
        if self._where[0] != step.generation:
            replica = self._shape.position(step.rank).replica
            self._where = (step.generation, step.world_size // self._shape.size, replica)
        return self._where[1], self._where[2]

    def _share(self, step: Step) -> list[data_math.Loaded]:
        """This worker's share of `step`: its replica's, which every worker of a replica computes on."""
        loaded = self.loader.step(step.cursor, *self._peers(step))
        if self._faults.slow_extra_s:
            time.sleep(self._faults.slow_extra_s)  # an injected straggler
        return loaded

    def micro_batches(self, step: Step) -> Iterator[MicroBatch]:
        model = self._model()
        model.check_micro_batches()
        peers = self._peers(step)[0]
        with phase("elastic.data"):
            loaded = self._share(step)
        for i, micro in enumerate(loaded):
            last = i == len(loaded) - 1
            with phase("elastic.data"):
                data = to_device(micro.data, self._device)
            batch = MicroBatch(
                data=data,
                indices=micro.indices,
                weight=data_math.gradient_weight(micro.samples, peers, step.samples),
                on_sync=functools.partial(self._probe.enter_sync, step) if last else None,
                synced=model.after_last_backward(step) if last else None,
                run_backward=self._techniques.precision.backward,
                step=step,
            )
            step.given += 1
            with model.accumulating(last):  # left at once when the loop stops early: DDP's no_sync ends
                yield batch

    def batch(self, step: Step) -> Any:
        return self._model().batch(step, lambda: self._share(step), lambda: self._backpropagated(step))

    def _backpropagated(self, step: Step) -> None:
        step.weighted += 1
        self._probe.enter_sync(step)

    def check_weighted(self, step: Step | None) -> None:
        """Before the optimizer steps: every micro-batch of the step went through mb.backward."""
        if step is None or step.weighted >= step.given:
            return
        error = self._model().unweighted_error(step)
        if error is not None:
            raise error
        raise UnweightedBackwardError(
            f"step {step.index}: {step.given - step.weighted} of the {step.given} micro-batches were "
            "backpropagated without mb.backward(loss); a plain loss.backward() leaves out the micro-batch's "
            "weight (its share of the global batch), so the gradients would be wrong at this world size. "
            "Call mb.backward(loss) for every micro-batch of step.micro_batches()"
        )
