"""elastic: elastic data-parallel training on Ray that heals in place."""

from elastic.config import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from elastic.context import MicroBatch, Step, TrainContext, get_context, report
from elastic.data import DataCursor, ParquetDataset
from elastic.errors import CapacityTimeoutError, ElasticError, TrainingFailedError
from elastic.faults import Fault, parse_fault
from elastic.trainer import ElasticTrainer, Result

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
    "RunConfig",
    "ScalingConfig",
    "Step",
    "TrainContext",
    "TrainingFailedError",
    "get_context",
    "parse_fault",
    "report",
]
