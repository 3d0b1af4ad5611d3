"""The exceptions a user of elastic can see. One base class, one subclass per failure kind.

Every message says what happened and how to fix it. All of them pickle across actors.
"""

from __future__ import annotations


class ElasticError(Exception):
    """Base class of every error raised by elastic."""


class TrainingFailedError(ElasticError):
    """The train loop raised on a worker; carries the rank and the remote traceback."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank, self.traceback))

    def __str__(self) -> str:
        return f"{self.args[0]}\n\nRemote traceback (rank {self.rank}):\n{self.traceback}" if self.traceback else self.args[0]


class CapacityTimeoutError(ElasticError):
    """Fewer than min_workers workers could run for longer than the capacity timeout."""


class WorkerEvictedError(ElasticError):
    """The controller removed this worker from the run; its train loop stops."""


class StateLostError(ElasticError):
    """No live process holds a piece of the run's state (a ZeRO shard whose owner and buddies
    died); the controller restarts the run from its latest complete checkpoint."""


class UnweightedBackwardError(ElasticError):
    """A micro-batch was backpropagated without `mb.backward(loss)`, so its gradient lacks its weight."""


class ReportedCheckpointError(ElasticError):
    """`elastic.report(checkpoint=...)` got a checkpoint it cannot store; the message says why and what to pass."""
