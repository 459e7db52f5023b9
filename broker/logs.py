"""Logging: plain text for people, or one JSON object per line for log pipelines.

``BROKER_LOG_FORMAT=json`` turns every record into ``{"ts", "level", "logger", "message", ...}``
plus the ids the record carries (``turn_id``, ``conversation_id``, ``stream_id``, ``attempt``,
...). Each attempt's end is one line with ``"event": "attempt_ended"`` and its status and reason.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import orjson

# Attributes a record carries when the broker passes them as `extra`; everything else is noise.
CONTEXT_FIELDS = (
    "event",
    "turn_id",
    "conversation_id",
    "stream_id",
    "attempt",
    "strategy",
    "status",
    "reason",
    "provider",
    "model",
    "tool",
    "ordinal",
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in CONTEXT_FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure(level: str, fmt: str) -> None:
    """Set up the root logger once, in the chosen format."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if fmt == "json":
        # uvicorn installs its own text handlers; route its records through ours instead.
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logger = logging.getLogger(name)
            logger.handlers[:] = []
            logger.propagate = True
