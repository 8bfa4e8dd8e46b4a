"""Resident memory of worker processes over time, to test the zero-memory-overhead claim.

A background thread reads each live worker's VmRSS from /proc every `interval_s` and
keeps (time, rss) per rank; the benchmark then asks for the peak inside a time window
(steady state before an event vs. the migration itself).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

MIB = 1024 * 1024


def rss_bytes(pid: int) -> int | None:
    """Current resident set size of `pid`, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


class RssSampler:
    """Samples the RSS of the processes `targets()` returns (label -> pid), re-read at
    every tick so processes started later (standbys) are picked up."""

    def __init__(self, targets: Callable[[], dict[str, int]], interval_s: float = 0.05):
        self.targets, self.interval_s = targets, interval_s
        self.samples: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for label, pid in list(self.targets().items()):
                rss = rss_bytes(pid)
                if rss is not None:
                    self.samples[label].append((now, rss))
            self._stop.wait(self.interval_s)

    def peak_mib(self, label: str, start: float, end: float) -> float | None:
        """Largest RSS of `label` seen in [start, end], in MiB."""
        values = [rss for t, rss in list(self.samples.get(label, [])) if start <= t <= end]
        return max(values) / MIB if values else None
