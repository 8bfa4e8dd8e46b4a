"""The supervising side of the control API for a set of local ranks: processes and events.

Whoever supervises workers (the local driver for a whole job, a sidecar for one
machine) starts them with `spawn_worker`, routes their control events into a
`RankTracker`, and waits on it: every wait has a deadline and fails at once, with the
tail of the worker's log, when a worker process dies instead of running into it.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from trainmover.runtime import control as c
from trainmover.runtime.plan import RankRef

T = TypeVar("T")


class WorkerDied(RuntimeError):
    """A worker process exited unexpectedly."""


class RankTracker:
    """What the supervised ranks reported, and their processes; safe across threads.

    Control events arrive on the control server's reader threads (`on_event`); waits
    run on any other thread.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._cond = threading.Condition()
        self.last_step: dict[RankRef, int] = {}
        #: step -> rank -> its StepDone
        self.steps: dict[int, dict[RankRef, c.StepDone]] = defaultdict(dict)
        self.ready: dict[str, dict[RankRef, c.Ready]] = defaultdict(dict)
        self.switched: dict[str, dict[RankRef, c.Switched]] = defaultdict(dict)
        self.failed: dict[str, dict[RankRef, c.PlanFailed]] = defaultdict(dict)
        self.exited: dict[RankRef, c.Exited] = {}
        self.procs: dict[RankRef, subprocess.Popen[bytes]] = {}
        self.listeners: list[Callable[[RankRef, c.Message], None]] = []

    def on_event(self, ref: RankRef, msg: c.Message) -> None:
        with self._cond:
            if isinstance(msg, c.StepDone):
                self.last_step[ref] = msg.step
                self.steps[msg.step][ref] = msg
            elif isinstance(msg, c.Ready):
                self.ready[msg.plan_id][ref] = msg
            elif isinstance(msg, c.Switched):
                self.switched[msg.plan_id][ref] = msg
                # A joiner starts out having completed the leaver's steps.
                self.last_step[ref] = max(self.last_step.get(ref, 0), msg.step)
            elif isinstance(msg, c.PlanFailed):
                self.failed[msg.plan_id][ref] = msg
            elif isinstance(msg, c.Exited):
                self.exited[ref] = msg
            self._cond.notify_all()
        for listener in self.listeners:
            listener(ref, msg)

    def add_process(self, ref: RankRef, proc: subprocess.Popen[bytes]) -> None:
        with self._cond:
            self.procs[ref] = proc
            self.exited.pop(ref, None)
            self.last_step.pop(ref, None)

    def wait(
        self,
        predicate: Callable[[], T],
        timeout_s: float,
        what: str,
        refs: Iterable[RankRef] | None = None,
    ) -> T:
        """Waits for `predicate` to be truthy, failing fast if a worker of `refs` died."""
        watched = None if refs is None else set(refs)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                result = predicate()
                if result:
                    return result
                self.check_alive(watched)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"timed out waiting for {what}")
                # Woken by every worker event; the cap only bounds how late a silent
                # process death is noticed.
                self._cond.wait(min(remaining, 0.5))

    def check_alive(self, refs: set[RankRef] | None = None) -> None:
        """Raises WorkerDied for a worker that exited with an error."""
        for ref, proc in list(self.procs.items()):
            if refs is not None and ref not in refs:
                continue
            code = proc.poll()
            if code is None:
                continue
            exited = self.exited.get(ref)
            if code != 0 or (exited is not None and exited.reason == "error"):
                raise WorkerDied(f"{ref} exited with {code}:\n{self.log_tail(ref)}")

    def log_tail(self, ref: RankRef, chars: int = 3000) -> str:
        log = self.run_dir / "logs" / f"{ref.machine}-{ref.local_rank}.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""

    def live(self) -> list[RankRef]:
        with self._cond:
            return [r for r, p in self.procs.items() if p.poll() is None and r not in self.exited]

    def step_of(self, ref: RankRef) -> int:
        with self._cond:
            return self.last_step.get(ref, 0)

    def step_ends(self, step: int, refs: Iterable[RankRef]) -> dict[RankRef, float]:
        """When each of `refs` finished `step` (wall clock), for those that reported it."""
        with self._cond:
            done = self.steps.get(step, {})
            return {r: done[r].t_end for r in refs if r in done}


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """Waits up to `grace_s` for processes to exit, then terminates, then kills."""
    procs = list(procs)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
