"""The rank in every log record of elastic's loggers in a worker process.

Each module logs through `logging.getLogger(__name__)` (`elastic.worker.membership`, ...), so a
user picks what to see by logger name, as with any library. In a worker, `record_rank` adds the
worker's current rank to each record of those loggers as `record.rank` (-1 outside a
generation), for a format such as `"%(rank)s %(name)s: %(message)s"`; other records get none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable


def record_rank(rank: Callable[[], int]) -> None:
    """Make every record of an `elastic` logger made in this process carry `rank()` as `record.rank`."""
    make = logging.getLogRecordFactory()

    def with_rank(name: str, *args, **kwargs) -> logging.LogRecord:
        record = make(name, *args, **kwargs)
        if name == "elastic" or name.startswith(("elastic.", "actors.")):
            record.rank = rank()
        return record

    logging.setLogRecordFactory(with_rank)
