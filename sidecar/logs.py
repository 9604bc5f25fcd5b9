"""Structured logging, configured once at start-up: one JSON object per line on stdout.

Every event carries `timestamp` (ISO-8601 UTC), `level`, `event` and `logger`; request context
(`request_id`, `trace_id`) comes from contextvars bound by the proxy. Tensor data, request bodies and
filtered outputs are never passed to a logger in the first place.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _NamedPrintLogger(structlog.PrintLogger):
    """A PrintLogger that knows its name, so `add_logger_name` can fill the `logger` field."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except BrokenPipeError:
            pass  # stdout's reader is gone; the sidecar's work must go on regardless

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


def _logger_factory(stream: TextIO) -> Any:
    def make(*args: Any) -> _NamedPrintLogger:
        return _NamedPrintLogger(stream, str(args[0]) if args else "sidecar")

    return make


def configure_logging(*, format: str = "json", level: str = "info", stream: TextIO | None = None) -> None:
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    if format == "console":
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    else:
        processors.append(structlog.processors.JSONRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=_logger_factory(stream or sys.stdout),
        cache_logger_on_first_use=False,
    )

