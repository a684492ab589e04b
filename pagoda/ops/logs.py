"""Logging for the server's two processes: one format for every logger (ours, uvicorn's, warnings),
text or JSON lines, and the request id on every line about a request.

A line is about a request when it is logged with `extra={"request_id": ...}` or while the
`request_id_var` context variable is set (the HTTP handlers set it for the request they serve).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from pagoda.serve.request_context import request_id_var

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# Attributes every LogRecord has; anything else was passed through `extra` and goes into JSON lines.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "process_tag", "color_message",  # uvicorn adds color_message: a copy with ANSI colours
}


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` (None when the line is not about a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self, process_tag: str) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(process_tag)s] %(name)s: %(message)s")
        self.process_tag = process_tag

    def format(self, record: logging.LogRecord) -> str:
        record.process_tag = self.process_tag
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        if rid is not None:
            # Before the message, so `grep 'request_id=cmpl-...'` finds every line of a request.
            head, sep, tail = line.partition(": ")
            line = f"{head}: [request_id={rid}] {tail}" if sep else f"[request_id={rid}] {line}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, process, logger, message, request_id and any extras."""

    def __init__(self, process_tag: str) -> None:
        super().__init__()
        self.process_tag = process_tag

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "process": self.process_tag,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            obj["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in obj and key != "request_id":
                obj[key] = value
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        # Newlines inside values are escaped by json.dumps, so a traceback stays on one line.
        return json.dumps(obj, default=str)


def configure_logging(level: str = "info", fmt: str = "text", process_tag: str = "api") -> None:
    """Route every logger through one stderr handler with the chosen format (idempotent)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process_tag) if fmt == "json" else TextFormatter(process_tag))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # uvicorn's loggers (run with log_config=None) and warnings.warn go through the same handler.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    logging.captureWarnings(True)


class LogSetup:
    """A picklable `configure_logging` call, for the engine-core process to run first thing."""

    def __init__(self, level: str = "info", fmt: str = "text", process_tag: str = "engine-core") -> None:
        self.level, self.fmt, self.process_tag = level, fmt, process_tag

    def __call__(self) -> None:
        configure_logging(self.level, self.fmt, self.process_tag)
