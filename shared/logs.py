"""Structured logging: one event per line, JSON or console, with job/machine/plan context.

Every service calls `configure()` once at start and `get_logger(service, ...)` for a
logger bound to its context; bind `plan_id` (and `event_id`) while handling a plan.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

FORMAT_ENV = "TRAINMOVER_LOG_FORMAT"
LEVEL_ENV = "TRAINMOVER_LOG_LEVEL"

# Keys whose values must never reach a log line.
_SECRET_KEYS = frozenset(
    {"password", "token", "secret", "nkey", "seed", "authorization", "user_password", "creds"}
)


def _redact(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in event:
        if key.lower() in _SECRET_KEYS:
            event[key] = "***"
    return event


def configure(
    fmt: str | None = None, level: str | None = None, stream: TextIO | None = None
) -> None:
    """Sets up structlog: `fmt` is "json" or "console" (default from $TRAINMOVER_LOG_FORMAT,
    else console on a terminal and JSON otherwise)."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or ("console" if sys.stderr.isatty() else "json")
    level_name = (level or os.environ.get(LEVEL_ENV) or "info").upper()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(service: str, **context: Any) -> structlog.stdlib.BoundLogger:
    """A logger bound to `service` and the given context (job, machine, plan_id...)."""
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(service=service, **context)
    return logger
