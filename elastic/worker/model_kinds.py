"""The factory of prepared models: `prepare` picks the kind of a run's model once, from its shape
and strategy (see `elastic.parallel.prepared` for the interface every kind implements).

Adding a kind of prepared model is one module implementing `PreparedModel` and one line here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from elastic.comm.state_sync import RunState
from elastic.errors import ElasticError
from elastic.parallel.prepared import WorkerPlace, PreparedModel
from elastic.parallel.replica_model import ReplicaModel
from elastic.techniques.strategy import Techniques
from elastic.worker.data_parallel import DataParallelModel, ShardedModel


def prepare(place: WorkerPlace, techniques: Techniques, model: torch.nn.Module | None, state: RunState,
            loss_fn: Callable | None = None, tensor_parallel_plan: Any = None,
            split_points: Sequence[int] | None = None) -> PreparedModel:
    """The prepared model of this run's kind, holding `model`, whose synced state it sets on `state`
    (`ctx.prepare_model(model, loss_fn, **options)`). Before prepare_model (`model` None) the kind holds no
    model but forms the same groups and cuts the same batches. Torch's pipelining and DTensor take seconds
    to import: only the runs of a kind import its module.

    With ScalingConfig(pipeline_stages > 1), `model` is an nn.Sequential cut into that many stages and
    `loss_fn(outputs, targets)` the mean loss the last stage computes: the returned `PipelinedReplica`
    holds this worker's stage (elastic.parallel.pipelined_replica); the stages are cut evenly by layer
    count, or where `split_points` say (the index of the layer each stage after the first begins with).
    With ScalingConfig(tensor_parallel > 1), `tensor_parallel_plan` (by default the model's
    `tensor_parallel_plan()`) cuts its layers across the replica's workers: the returned
    `TensorParallelReplica` holds this worker's slices (elastic.parallel.tensor_parallel_replica).
    """
    shape = place.shape
    if tensor_parallel_plan is not None and shape.tensor_parallel == 1:
        raise ElasticError("prepare_model(model, tensor_parallel_plan=...) takes a plan only in a tensor-parallel "
                           "run (ScalingConfig(tensor_parallel > 1))")
    if split_points is not None and shape.pipeline_stages == 1:
        raise ElasticError("prepare_model(model, split_points=...) cuts pipeline stages: it takes split points "
                           "only in a pipelined run (ScalingConfig(pipeline_stages > 1))")
    if shape.pipeline_stages > 1:
        from elastic.parallel.pipelined_replica import PipelinedKind
        return PipelinedKind(place, model, state, loss_fn, tensor_parallel_plan, split_points)
    if model is None:
        return ReplicaModel(shape, place.slot, place.device) if shape.size > 1 else \
            DataParallelModel(place, techniques, None, state)
    if shape.tensor_parallel > 1:
        from elastic.parallel.tensor_parallel_replica import TensorParallelKind
        return TensorParallelKind(place, model, state, tensor_parallel_plan)
    if loss_fn is not None:
        raise ElasticError("prepare_model(model, loss_fn) takes a loss_fn only in a pipelined run "
                           "(ScalingConfig(pipeline_stages > 1)); compute the loss in the train loop instead")
    return (ShardedModel if place.strategy.zero >= 2 else DataParallelModel)(place, techniques, model, state)
