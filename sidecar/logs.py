"""Structured logs: one event per line, with fields, through the standard `logging` module.

    log_event(logger, logging.INFO, "eds.published", pool="chat", version="ab12")

JSON lines by default ({"ts", "level", "logger", "event", ...fields}); `text` prints
`event key=value ...` for humans.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, TextIO

__all__ = ["configure", "log_event"]

_FIELDS = "confgen_fields"


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """Log `event` with its fields (values must be JSON-serialisable or are str()-ed)."""
    logger.log(level, event, extra={_FIELDS: fields})


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        line.update(getattr(record, _FIELDS, {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, _FIELDS, {})
        parts = [f"{k}={json.dumps(v, default=str, ensure_ascii=False)}" for k, v in fields.items()]
        text = " ".join([time.strftime("%H:%M:%S"), record.levelname.lower(), record.getMessage(), *parts])
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure(fmt: str, level: str, stream: TextIO) -> None:
    """Route the root logger to `stream` in `fmt` ("json" or "text"); call once, from main."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # aiohttp's access log would print a line per scrape of /metrics.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
