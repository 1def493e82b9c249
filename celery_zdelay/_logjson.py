"""One JSON object per log line, for ``celery -A proj zdelay --log-format json``.

Log collectors (Loki, Elasticsearch, Cloud Logging) index the fields, so an
operator can search by task id or shard instead of parsing message text.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

__all__ = ["JsonFormatter"]

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


class JsonFormatter(logging.Formatter):
    """Format a record as one line of JSON.

    Fields: ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``,
    ``message``, every field passed with ``extra=`` (such as ``task_id``,
    ``task_name``, ``shard``), and ``exception`` when there is one.
    """

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created, tz=timezone.utc)
        line: dict[str, Any] = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=repr)
