"""A worker process's CPU as the kernel reports it, for the sidecar's heartbeats.

A rank whose beacon stopped beating is either stopped (SIGSTOP, a debugger, a frozen
host), cut off from the store, or alive but starved of a CPU on an overloaded host. The
judge on another machine cannot tell these apart; the sidecar beside the process can:
a starved process has threads runnable (state R) that get little CPU and pile up
run-queue delay, a stopped or blocked one has none runnable. Read from /proc: the
process's CPU time (utime + stime) and, per thread, its state and run-queue delay
(`schedstat`, which grows when a queued thread finally runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    """One reading of a process: CPU seconds used, seconds its threads waited for a CPU
    (summed), and how many of its threads were running or runnable."""

    cpu_s: float
    cpu_wait_s: float
    runnable_threads: int


def _stat_fields(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (state is [0])."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def sample(pid: int) -> CpuSample | None:
    """A reading of process `pid`; None when it cannot be read (gone, or not Linux)."""
    try:
        fields = _stat_fields(f"/proc/{pid}/stat")
        tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, IndexError):
        return None
    cpu_s = (int(fields[11]) + int(fields[12])) * _TICK_S
    waited, runnable = 0.0, 0
    for tid in tids:
        try:
            state = _stat_fields(f"/proc/{pid}/task/{tid}/stat")[0]
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                waited += int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # the thread ended between the listing and the read
        runnable += state == "R"
    return CpuSample(cpu_s, waited, runnable)
