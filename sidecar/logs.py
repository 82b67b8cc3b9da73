"""Structured logs: one event per line, with fields, through the standard `logging` module.

    log_event(logger, logging.INFO, "eds.published", pool="chat", version="ab12")

JSON lines by default ({"ts", "level", "logger", "event", ...fields}); `text` prints
`event key=value ...` for humans.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["LogBudget", "clip", "configure", "log_event"]

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
    # aiohttp's server logs a request it cannot parse at ERROR with a traceback and the client's bytes (one line
    # of 460,000 characters seen; 200 such connections wrote 24 MB in 0.04 s): clipped, no traceback, at most a
    # burst a minute
    logging.getLogger("aiohttp.server").addFilter(_ClientNoise(time.monotonic))


class _ClientNoise(logging.Filter):
    """What a client makes a library log: the message clipped to 300 characters, no traceback, at most
    `burst` records a `window_s` (the next one after says how many were dropped)."""

    def __init__(self, clock: Callable[[], float], burst: int = 20, window_s: float = 60.0) -> None:
        super().__init__()
        self._clock, self._burst, self._window_s = clock, burst, window_s
        self._since = -math.inf
        self._count = self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        if now >= self._since + self._window_s:
            self._since, self._count = now, 0
        self._count += 1
        if self._count > self._burst:
            self._dropped += 1
            return False
        text = clip(record.getMessage(), 300)
        if self._dropped:
            text += f" ({self._dropped} more dropped before this one)"
            self._dropped = 0
        record.msg, record.args, record.exc_info, record.exc_text, record.stack_info = text, None, None, None, None
        return True


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how much was cut (for what a client sent)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...(+{len(text) - limit} chars)"


class LogBudget:
    """Per-client log volume: at most `burst` events per `window_s` per key, then one note.

    A client that makes the daemon log (a NACK storm, reconnect loops, refused handshakes)
    gets `burst` lines per window; the rest are counted and reported with its next allowed
    line (`suppressed=N`). At most `max_keys` clients are tracked (the oldest forgotten
    first), so the table itself is bounded."""

    def __init__(self, clock: Callable[[], float], burst: int = 20, window_s: float = 60.0,
                 max_keys: int = 1024) -> None:
        self._clock = clock
        self._burst, self._window, self._max_keys = burst, window_s, max_keys
        self._keys: dict[str, list[float]] = {}  # key -> [window start, used, suppressed]
        self.suppressed_total = 0

    def log(self, logger: logging.Logger, level: int, key: str, event: str, **fields: Any) -> bool:
        """Log unless `key` spent its budget; True when logged."""
        now = self._clock()
        entry = self._keys.get(key)
        if entry is None or now - entry[0] >= self._window:
            if entry is None and len(self._keys) >= self._max_keys:
                del self._keys[next(iter(self._keys))]
            suppressed = int(entry[2]) if entry is not None else 0
            entry = self._keys[key] = [now, 0.0, 0.0]
            if suppressed:
                fields["suppressed"] = suppressed
        if entry[1] >= self._burst:
            entry[2] += 1
            self.suppressed_total += 1
            return False
        entry[1] += 1
        if entry[1] == self._burst:
            fields["note_budget"] = f"last line for this client for {self._window:g}s; the rest are counted"
        log_event(logger, level, event, **fields)
        return True
