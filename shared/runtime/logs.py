"""Structured logs of the runtime: one JSON event per line on stderr, bound to the job,
machine, rank and (while one runs) the plan."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(level: int = logging.INFO) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**context: Any) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger("trainmover.runtime", **context)
