"""Structured logging: one event per line, JSON or console, with job/machine/plan context.

Every service calls `configure()` once at start and `get_logger(service, ...)` for a
logger bound to its context; bind `plan_id` (and `event_id`) while handling a plan.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

FORMAT_ENV = "TRAINMOVER_LOG_FORMAT"
LEVEL_ENV = "TRAINMOVER_LOG_LEVEL"

# Keys whose values must never reach a log line.
_SECRET_KEYS = frozenset(
    {
        "password",
        "passwd",
        "pass",
        "token",
        "secret",
        "nkey",
        "seed",
        "nkey_seed",
        "authorization",
        "user_password",
        "creds",
        "credentials",
        "webhook_token",
        "bcrypt",
        "password_hash",
    }
)

# Secrets by value: every credential loaded (trainmover.security.credentials) is added,
# so a value that reaches a log line under an innocent key (an error message quoting
# it) still prints masked. Also masked: NKey seeds and user:password@ in URLs.
_secret_values: set[str] = set()
_PATTERNS = (
    re.compile(r"\bS[UNOACP][A-Z2-7]{56}\b"),  # NKey seeds
    re.compile(r"(?<=://)[^/@\s:]*:[^/@\s]*(?=@)"),  # URL userinfo with a password
)
_MIN_SECRET_LEN = 6  # shorter "secrets" would mask ordinary words


def add_secret(value: str) -> None:
    """Registers a secret value: any log line containing it prints it as ***."""
    if value and len(value) >= _MIN_SECRET_LEN:
        _secret_values.add(value)


def redact_text(text: str) -> str:
    """`text` with registered secrets, NKey seeds and URL passwords masked."""
    for secret in _secret_values:
        if secret in text:
            text = text.replace(secret, "***")
    for pattern in _PATTERNS:
        text = pattern.sub("***", text)
    return text


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_clean(v) for v in value)
    if isinstance(value, dict):
        return {k: "***" if str(k).lower() in _SECRET_KEYS else _clean(v) for k, v in value.items()}
    return value


def _redact(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in event:
        if key.lower() in _SECRET_KEYS:
            event[key] = "***"
        elif key != "exc_info":  # format_exc_info needs it as it is
            event[key] = _clean(event[key])
    return event


def _redact_rendered(_logger: Any, _name: str, line: Any) -> Any:
    # Last line of defence: tracebacks are rendered after _redact ran.
    return redact_text(line) if isinstance(line, str) else line


def stacks_on_sigusr1() -> None:
    """The process writes the stack of each of its threads to its stderr at SIGUSR1 and
    goes on (`kill -USR1 PID`): where a service or a worker waits, without a debugger."""
    # An stderr without a file descriptor (a caller's capture) cannot take the dump:
    # the process's own stderr can.
    for stream in (sys.stderr, sys.__stderr__):
        if stream is None:
            continue
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, OSError, ValueError):
            continue


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
            _redact_rendered,
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
