"""The runtime's logs: the project's one logging set-up (trainmover.logs) as every worker
uses it. One JSON event per line on stderr, secrets redacted by key and by value, each
line bound to the job, machine, rank and (while one runs) the plan.
"""

from __future__ import annotations

from typing import Any, TextIO

import structlog

from trainmover import logs

SERVICE = "runtime"

_MIB = 1024 * 1024
"""The `service` key of every runtime log line (the services name their own)."""


def configure(level: str | None = None, stream: TextIO | None = None) -> None:
    """Sets up logging in a worker: JSON lines on `stream` (default stderr), at `level`
    (default from $TRAINMOVER_LOG_LEVEL, else info); the threads' stacks go to stderr at
    SIGUSR1, as a service's do."""
    logs.configure("json", level, stream)
    logs.stacks_on_sigusr1()


def get_logger(**context: Any) -> structlog.stdlib.BoundLogger:
    """A runtime logger bound to `context` (job, machine, local_rank, plan_id...)."""
    return logs.get_logger(SERVICE, **context)


def peak_rss_mib() -> float | None:
    """This process's peak resident memory so far (VmHWM), in MiB; None where the system
    does not say. Logged as a state transfer starts and once the migration is over
    (and, for a stayer, at the commit), so what a transfer costs in memory on top of
    training is read from the workers' own logs."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) * 1024 / _MIB, 1)
    except OSError:
        return None
    return None
