"""CPU seconds the training processes spend per step: the work a wrapper adds, read
where the step period cannot show it.

On a host whose cores are all busy (8 ranks on 2 cores here), the step period moves by
tens of percent between windows minutes apart, with the host's load. The CPU time the
rank processes spend per step leaves out the time they waited for a CPU, so it shows a
runtime's own work per step (its threads, its bookkeeping of each collective, the commit
vote) apart from the queueing. It still moves with contention for caches and memory
(a third between repetitions on this host): read it over several runs. Linux only
(`/proc`); elsewhere nothing is found and the measurement is reported missing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
#: How often the CPU totals are sampled while a window is measured: the reading at a
#: step's end is interpolated between two samples this far apart.
SAMPLE_S = 0.05


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state is [0], ppid [1])."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def ranks_matching(marker: str, parent_marker: str = "") -> list[int]:
    """Live processes whose command line contains `marker` (and whose parent's contains
    `parent_marker`, where given): a job's rank processes."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if marker not in _cmdline(pid):
                continue
            if parent_marker and parent_marker not in _cmdline(int(_stat(pid)[1])):
                continue
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        found.append(pid)
    return found


def cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes `pids` have used (those still alive)."""
    total = 0
    for pid in pids:
        try:
            fields = _stat(pid)
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total * _TICK_S


def _at(samples: list[tuple[float, float]], t: float) -> float | None:
    """The CPU total at time `t`, linear between the samples around it."""
    for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
        if t0 <= t <= t1:
            return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    return None


def cpu_per_step(
    pids: list[int],
    current_step: Callable[[], int],
    wait_step: Callable[[int], object],
    stamps: Callable[[], dict[int, float]],
    steps: int,
    first: int | None = None,
) -> float | None:
    """CPU seconds the processes `pids` spend per step over the `steps` whole steps after
    step `first` (default: the step in flight), from their CPU totals sampled every
    `SAMPLE_S` and read at the steps' end stamps (`stamps`: step -> wall time;
    `current_step` and `wait_step` are the job's). None when no process was found or the
    stamps fall outside the samples."""
    if not pids:
        return None
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while True:
            samples.append((time.time(), cpu_s(pids)))
            if stop.wait(SAMPLE_S):
                samples.append((time.time(), cpu_s(pids)))
                return

    sampler = threading.Thread(target=sample, name="cpu-sampler", daemon=True)
    sampler.start()
    if first is None:
        first = current_step() + 1  # ends after the first sample
    try:
        wait_step(first + steps)
    finally:
        stop.set()
        sampler.join()
    ends = stamps()
    if first not in ends or first + steps not in ends:
        return None
    begin, end = _at(samples, ends[first]), _at(samples, ends[first + steps])
    return None if begin is None or end is None else (end - begin) / steps
