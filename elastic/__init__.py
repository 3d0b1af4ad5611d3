"""elastic: elastic data-parallel training on Ray that heals in place.

`ElasticTrainer` and `Result` are imported on first use, so that the pure modules (and a
worker's train loop) can be imported without pulling in the driver's side; so is
`ParquetDataset`, whose pyarrow.dataset takes a worker process a third of a second to import.
"""

from elastic.config import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig, Strategy
from elastic.data.order import DataCursor
from elastic.errors import (
    CapacityTimeoutError,
    ElasticError,
    ReportedCheckpointError,
    TrainingFailedError,
    UnweightedBackwardError,
)
from elastic.faults import Fault, parse_fault
from elastic.worker.context import (TrainContext, get_checkpoint, get_context, prepare_data_loader, prepare_model,
                                    prepare_optimizer, report)
from elastic.worker.step import MicroBatch, Step

__all__ = [
    "CapacityTimeoutError",
    "CheckpointConfig",
    "DataConfig",
    "DataCursor",
    "ElasticError",
    "ElasticTrainer",
    "FailureConfig",
    "Fault",
    "MicroBatch",
    "ParquetDataset",
    "Result",
    "ReportedCheckpointError",
    "RunConfig",
    "ScalingConfig",
    "Step",
    "Strategy",
    "TrainContext",
    "TrainingFailedError",
    "UnweightedBackwardError",
    "get_checkpoint",
    "get_context",
    "parse_fault",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
    "report",
]


def __getattr__(name: str):
    if name in ("ElasticTrainer", "Result"):
        from elastic import trainer

        return getattr(trainer, name)
    if name == "ParquetDataset":
        from elastic.data.parquet import ParquetDataset

        return ParquetDataset
    raise AttributeError(f"module 'elastic' has no attribute {name!r}")
