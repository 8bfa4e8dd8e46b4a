"""The supervising side of the control API for a set of local ranks: processes and events.

Whoever supervises workers (a sidecar for its machine, or the in-process harness for
every machine of a job) starts them with a `WorkerStarter`, routes their control events into a
`RankTracker`, and waits on it: every wait has a deadline and fails at once, with the
tail of the worker's log, when a worker process dies instead of running into it (unless
it is known lost: a failed machine being recovered). `RankCommands` sends the control
API's commands to a set of ranks and waits for their outcome; `LocalJob` uses it for a
whole job, a sidecar for its machine's ranks.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from trainmover.runtime import control as c
from trainmover.runtime.plan import Plan, RankRef

if TYPE_CHECKING:
    from trainmover.runtime.launcher import ControlServer, WorkerProcess

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
        self.procs: dict[RankRef, WorkerProcess] = {}
        self.listeners: list[Callable[[RankRef, c.Message], None]] = []
        #: Unplanned path: shadow warm-ups, collective errors, discarded steps, every
        #: committed step in order (re-executions included), ranks known lost.
        self.warmed: dict[RankRef, c.Warmed] = {}
        self.collective_errors: list[tuple[RankRef, c.CollectiveErrorEvent]] = []
        self.aborted: dict[RankRef, list[c.StepAbortedEvent]] = defaultdict(list)
        self.history: list[tuple[RankRef, c.StepDone]] = []
        self.disconnected: dict[RankRef, float] = {}
        self.lost: set[RankRef] = set()

    def on_event(self, ref: RankRef, msg: c.Message) -> None:
        with self._cond:
            if isinstance(msg, c.StepDone):
                self.last_step[ref] = msg.step
                self.steps[msg.step][ref] = msg
                self.history.append((ref, msg))
            elif isinstance(msg, c.Ready):
                self.ready[msg.plan_id][ref] = msg
            elif isinstance(msg, c.Switched):
                self.switched[msg.plan_id][ref] = msg
                if msg.source == "leaver":
                    # A joiner starts out having completed the leaver's steps.
                    self.last_step[ref] = max(self.last_step.get(ref, 0), msg.step)
                else:  # a recovery resumes every rank from one step (maybe an older one)
                    self.last_step[ref] = msg.step
                    self._forget_undone(msg.step, msg.t_start)
            elif isinstance(msg, c.Warmed):
                self.warmed[ref] = msg
            elif isinstance(msg, c.CollectiveErrorEvent):
                self.collective_errors.append((ref, msg))
            elif isinstance(msg, c.StepAbortedEvent):
                self.aborted[ref].append(msg)
            elif isinstance(msg, c.PlanFailed):
                self.failed[msg.plan_id][ref] = msg
            elif isinstance(msg, c.Exited):
                self.exited[ref] = msg
            self._cond.notify_all()
        for listener in self.listeners:
            listener(ref, msg)

    def on_disconnect(self, ref: RankRef) -> None:
        """A worker's control connection closed (it exited, or its machine died)."""
        with self._cond:
            self.disconnected[ref] = time.time()
            self._cond.notify_all()

    def mark_lost(self, refs: Iterable[RankRef]) -> None:
        """These ranks died with their machine; waits no longer fail because of them."""
        with self._cond:
            self.lost |= set(refs)

    def dead(self) -> list[RankRef]:
        """Ranks whose process died with an error and are not yet known lost."""
        with self._cond:
            return [
                r for r, p in self.procs.items() if r not in self.lost and p.poll() not in (None, 0)
            ]

    def add_process(self, ref: RankRef, proc: WorkerProcess) -> None:
        with self._cond:
            self.procs[ref] = proc
            self.exited.pop(ref, None)
            self.last_step.pop(ref, None)
            self.lost.discard(ref)
            self.disconnected.pop(ref, None)

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
            if (refs is not None and ref not in refs) or ref in self.lost:
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

    def ended(self, refs: Iterable[RankRef]) -> dict[RankRef, c.Exited]:
        """How each rank of `refs` whose worker has said goodbye ended."""
        with self._cond:
            return {r: self.exited[r] for r in refs if r in self.exited}

    def live(self) -> list[RankRef]:
        with self._cond:
            return [r for r, p in self.procs.items() if p.poll() is None and r not in self.exited]

    def _forget_undone(self, resumed: int, recovery_began: float) -> None:
        """A recovery from a checkpoint re-executes steps after `resumed` that some ranks
        had committed: their earlier reports (of ranks the recovery may have replaced)
        leave `steps`, which then holds one report per role (`history` keeps them)."""
        for step in [s for s in self.steps if s > resumed]:
            kept = {r: e for r, e in self.steps[step].items() if e.t_end > recovery_began}
            if kept:
                self.steps[step] = kept
            else:
                del self.steps[step]

    def step_of(self, ref: RankRef) -> int:
        with self._cond:
            return self.last_step.get(ref, 0)

    def step_ends(self, step: int, refs: Iterable[RankRef]) -> dict[RankRef, float]:
        """When each of `refs` finished `step` (wall clock), for those that reported it."""
        with self._cond:
            done = self.steps.get(step, {})
            return {r: done[r].t_end for r in refs if r in done}


class RankCommands:
    """The supervisor's side of the control API for a set of ranks: send a command to
    each, wait for the events that say it is done. `LocalJob` calls it with all of a
    job's ranks; a sidecar with its machine's ranks (the executor then fans out)."""

    def __init__(self, control: ControlServer, tracker: RankTracker, timeout_s: float):
        self.control, self.tracker, self.timeout_s = control, tracker, timeout_s

    def _each(self, refs: Iterable[RankRef], body: c.Message) -> dict[RankRef, c.Message]:
        return {r: self.control.request(r, body, self.timeout_s) for r in refs}

    # -- planned migration (part 1) --------------------------------------------------

    def prepare(
        self, refs: Iterable[RankRef], plan: Plan, store: str = ""
    ) -> dict[RankRef, c.Message]:
        """Phase 1; `store` tells joiners the rendezvous store (standbys are not told)."""
        return self._each(refs, c.Prepare(plan=plan, store=store))

    def wait_ready(
        self, refs: Iterable[RankRef], plan: Plan, timeout_s: float | None = None
    ) -> dict[RankRef, c.Ready]:
        refs = list(refs)

        def all_ready() -> bool:
            failed = self.tracker.failed.get(plan.plan_id)
            if failed:
                errors = "; ".join(f"{r}: {f.error}" for r, f in failed.items())
                raise RuntimeError(f"plan {plan.plan_id} failed: {errors}")
            return all(r in self.tracker.ready[plan.plan_id] for r in refs)

        self.tracker.wait(all_ready, timeout_s or self.timeout_s, f"ready of {plan.plan_id}")
        return {r: self.tracker.ready[plan.plan_id][r] for r in refs}

    def offer_commit(
        self, refs: Iterable[RankRef], plan: Plan, step: int
    ) -> dict[RankRef, c.CommitAck]:
        """Phase 2: each rank's answer to switching after `step` (it refuses when it
        already passed `step`, or is not ready)."""
        acks = self._each(refs, c.Commit(plan_id=plan.plan_id, step=step))
        return {r: a for r, a in acks.items() if isinstance(a, c.CommitAck)}

    def commit(self, refs: Iterable[RankRef], plan: Plan, step: int) -> dict[RankRef, c.CommitAck]:
        """Phase 2; raises when a rank refuses (it already passed `step`, or not ready)."""
        acks = self.offer_commit(refs, plan, step)
        refused = {str(r): a.reason for r, a in acks.items() if not a.accepted}
        if refused:
            raise RuntimeError(f"commit({step}) of {plan.plan_id} refused: {refused}")
        return acks

    def wait_switched(
        self, refs: Iterable[RankRef], plan: Plan, timeout_s: float | None = None
    ) -> dict[RankRef, c.Switched]:
        """Until each rank reported `switched` for `plan` (planned switch or recovery)."""
        refs = list(refs)
        self.tracker.wait(
            lambda: all(r in self.tracker.switched[plan.plan_id] for r in refs),
            timeout_s or self.timeout_s,
            f"switch of {plan.plan_id}",
        )
        return {r: self.tracker.switched[plan.plan_id][r] for r in refs}

    # -- warm-up, unplanned failures ----------------------------------------------------

    def warm(
        self,
        refs: Iterable[RankRef],
        role_types: list[str],
        iterations: int = 2,
        timeout_s: float | None = None,
    ) -> dict[RankRef, c.Warmed]:
        """Shadow iterations on standby ranks (all ranks of a machine at once: their TP
        group runs for real inside the sandbox); returns their `warmed` reports."""
        refs = list(refs)
        round_id = uuid.uuid4().hex[:12]
        with self.tracker._cond:
            for r in refs:
                self.tracker.warmed.pop(r, None)
        self._each(refs, c.Warm(role_types=role_types, iterations=iterations, round_id=round_id))
        self.tracker.wait(
            lambda: all(r in self.tracker.warmed for r in refs),
            timeout_s or self.timeout_s,
            "warm-up",
            refs,
        )
        return {r: self.tracker.warmed[r] for r in refs}

    def recover(
        self, refs: Iterable[RankRef], plan: Plan, store: str = ""
    ) -> dict[RankRef, c.RecoverAck]:
        """Sends the recover plan to every live rank of the job and the joiner's ranks;
        each aborts the epoch (if not done yet) and recovers at its next boundary."""
        acks = self._each(refs, c.Recover(plan=plan, store=store))
        return {r: a for r, a in acks.items() if isinstance(a, c.RecoverAck)}

    def abort(
        self, refs: Iterable[RankRef], epoch: str, reason: str = ""
    ) -> dict[RankRef, c.AbortAck]:
        """Aborts the in-flight step of `epoch` (one rank suffices: the store tells the
        others; sending it to all only makes it independent of any one)."""
        acks = self._each(refs, c.Abort(epoch=epoch, reason=reason))
        return {r: a for r, a in acks.items() if isinstance(a, c.AbortAck)}

    def status(self, refs: Iterable[RankRef], digest: bool = False) -> dict[RankRef, c.RankStatus]:
        """Each rank's status, with its last committed step and epoch."""
        replies = self._each(refs, c.Status(digest=digest))
        return {r: s for r, s in replies.items() if isinstance(s, c.RankStatus)}


def stop_processes(procs: Iterable[WorkerProcess], grace_s: float = 10.0) -> None:
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
