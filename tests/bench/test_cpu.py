"""CPU seconds per step of a set of processes (`trainmover.bench.cpu`), on real processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainmover.bench import cpu

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")

READY = "print('ready', flush=True)\n"
BURN = READY + "while True: pass  # {marker}"
SLEEP = READY + "import time\nwhile True: time.sleep(1)  # {marker}"


def _child(code: str, marker: str) -> subprocess.Popen[bytes]:
    """A child running `code`, returned once it runs: Popen returns as soon as the exec
    closed the child's close-on-exec pipe, before the kernel has set the new command
    line that /proc shows."""
    child = subprocess.Popen(
        [sys.executable, "-c", code.format(marker=marker)], stdout=subprocess.PIPE
    )
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


class _Steps:
    """A job whose steps end every `period_s` (a thread stamps them)."""

    def __init__(self, period_s: float) -> None:
        self.ends: dict[int, float] = {}
        self.step = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._period_s = period_s
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            with self._cond:
                self.step += 1
                self.ends[self.step] = time.time()
                self._cond.notify_all()

    def current(self) -> int:
        return self.step

    def wait(self, step: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.step >= step, 60)

    def stamps(self) -> dict[int, float]:
        with self._cond:
            return dict(self.ends)

    def stop(self) -> None:
        self._stop.set()


def test_ranks_are_found_by_their_command_line_and_their_parents() -> None:
    child = _child(SLEEP, "tm-cpu-test-marker")
    try:
        assert child.pid in cpu.ranks_matching("tm-cpu-test-marker")
        # Its parent (this test) does not carry the parent marker.
        assert cpu.ranks_matching("tm-cpu-test-marker", parent_marker="no-such-parent") == []
    finally:
        child.kill()
        child.wait()


def test_a_busy_process_spends_more_cpu_per_step_than_an_idle_one() -> None:
    busy, idle = _child(BURN, "tm-cpu-busy"), _child(SLEEP, "tm-cpu-idle")
    steps = _Steps(0.1)
    try:
        spent = {
            name: cpu.cpu_per_step([proc.pid], steps.current, steps.wait, steps.stamps, 10)
            for name, proc in (("busy", busy), ("idle", idle))
        }
        assert cpu.cpu_per_step([], steps.current, steps.wait, steps.stamps, 2) is None
    finally:
        steps.stop()
        for proc in (busy, idle):
            proc.kill()
            proc.wait()
    assert spent["busy"] is not None and spent["idle"] is not None
    assert spent["busy"] > 10 * spent["idle"] + 0.01
