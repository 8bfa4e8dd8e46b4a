"""Getting a rank out of a step that cannot finish: the per-rank abort signal and the
abortable wait on a collective's work.

A gloo collective blocked on a dead peer cannot be cancelled (`abort()`/`shutdown()` do
not unblock it), so no wait on a work item is unbounded: `wait_work` waits in short
slices and, between them, checks the rank's `AbortSignal`. Point-to-point works need
care: gloo's `wait(timeout)` on a send/recv *closes the pair* when it times out, and
their `is_completed()` stays False until someone waited; so a p2p work is waited (without
timeout) by a daemon `Waiter` thread and the training thread waits on its future in
slices instead. An abandoned p2p wait ends when its group is shut down. The signal is scoped by the
vote *epoch* it applies to (see `agreement.py`), so a late abort for an old epoch can
never hit the epoch that a recovery started. An abandoned work is never waited again and
its buffers are never reused; its group is marked dirty and rebuilt by the recovery.

A library that waits on a work's *future* in C++ (DDP's reducer, at the end of the
backward pass) never comes back to Python between slices: the future it gets is one the
signal completes with an error when the epoch is aborted (`AbortSignal.guard`), so it
leaves the step as promptly as a wait of our own.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch

#: Longest time between two checks of the abort signal while a collective is blocked.
POLL_S = 0.05
_POLL = timedelta(seconds=POLL_S)


class StepAborted(RuntimeError):
    """The in-flight step is discarded (its epoch was aborted); nothing of it is applied."""


class CollectiveError(StepAborted):
    """A collective failed (a peer's connection closed, or it did not finish in time)."""

    def __init__(self, group: str, peer_machine: str | None, error: str):
        super().__init__(f"{group}: {error}")
        self.group, self.peer_machine, self.error = group, peer_machine, error


FailureHandler = Callable[[CollectiveError], None]


class Waiter:
    """Daemon threads that block in `work.wait()` for point-to-point works (and works
    without a future), growing when all are busy (an abandoned wait holds its thread
    until the group is shut down).
    Daemon threads, not a ThreadPoolExecutor: its threads are joined at interpreter exit,
    which an abandoned wait would block."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, Future[None]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, work: Any) -> Future[None]:
        fut: Future[None] = Future()
        with self._lock:
            if self._idle == 0:
                threading.Thread(target=self._run, name="p2p-waiter", daemon=True).start()
            else:
                self._idle -= 1
        self._jobs.put((work, fut))
        return fut

    def _run(self) -> None:
        while True:
            work, fut = self._jobs.get()
            try:
                work.wait()
                fut.set_result(None)
            except BaseException as exc:  # handed to the waiting thread
                fut.set_exception(exc)
            # An idle waiter must not keep its last work alive (with the tensors its
            # future may hold: a shadow iteration's would outlive it).
            del work, fut
            with self._lock:
                self._idle += 1


WAITER = Waiter()


class _GuardedFuture:
    """`outer` completes once, with whichever comes first: `inner`'s outcome, or an
    abort. The outcome is set on a source future that `outer` is chained to: a Python
    `set_exception` alone leaves a C++ waiter a value, not an error, while a raising
    callback of `then` fails the chained future for C++ too."""

    def __init__(self, inner: torch.futures.Future[Any]) -> None:
        self._source: torch.futures.Future[Any] = torch.futures.Future()
        self.outer = self._source.then(_outcome)
        self._lock = threading.Lock()
        inner.add_done_callback(self._inner_done)

    @property
    def done(self) -> bool:
        return self._source.done()

    def _inner_done(self, inner: torch.futures.Future[Any]) -> None:
        try:
            value = inner.value()
        except Exception as exc:  # the work's own error, handed on as it is
            self._settle(self._source.set_exception, exc)
            return
        self._settle(self._source.set_result, value)

    def abort(self, message: str) -> None:
        self._settle(self._source.set_exception, StepAborted(message))

    def _settle(self, complete: Callable[[Any], None], outcome: Any) -> None:
        with self._lock:
            if not self._source.done():
                complete(outcome)


def _outcome(source: torch.futures.Future[Any]) -> Any:
    return source.value()  # raises the exception the source was set with


class AbortSignal:
    """Whether this rank's current epoch is aborted. Set from any thread (the commit
    vote watcher, the control reader, a failing collective); read by the training thread
    between slices of every wait."""

    def __init__(self, epoch: str = "e0", timeout_s: float = 120.0):
        self._cond = threading.Condition()
        self._epoch = epoch
        self._reason: str | None = None
        #: How long one collective may block before the rank gives up on the step.
        self.timeout_s = timeout_s
        #: Called (on the failing thread) for the first collective error of an epoch.
        self.on_failure: FailureHandler | None = None
        #: Called between two polls of a blocked wait with the seconds it has waited, so
        #: the progress board can name whoever holds the step back long before the
        #: timeout (`trainmover.runtime.progress`).
        self.on_wait: Callable[[float], None] | None = None
        #: Futures handed to libraries for the current epoch, failed by its abort.
        self._guarded: list[_GuardedFuture] = []

    @property
    def epoch(self) -> str:
        with self._cond:
            return self._epoch

    @property
    def reason(self) -> str | None:
        with self._cond:
            return self._reason

    def is_set(self) -> bool:
        with self._cond:
            return self._reason is not None

    def wait(self, timeout_s: float) -> bool:
        """Blocks until the current epoch is aborted (True) or `timeout_s` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: self._reason is not None, timeout_s)

    def set(self, epoch: str, reason: str) -> bool:
        """Aborts `epoch` if it is the current one; False for a stale (late) signal."""
        with self._cond:
            if epoch != self._epoch:
                return False
            if self._reason is None:
                self._reason = reason
            self._cond.notify_all()
            guarded, self._guarded = self._guarded, []
            message = f"step aborted ({self._reason})"
        # Outside the lock: failing a future runs the library's callbacks here.
        for future in guarded:
            future.abort(message)
        return True

    def reset(self, epoch: str) -> None:
        """A recovery starts `epoch`: clear the abort of the previous one."""
        with self._cond:
            self._epoch, self._reason = epoch, None
            self._guarded = []
            self._cond.notify_all()

    def guard(self, inner: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
        """A future with `inner`'s outcome, or failed with StepAborted's message once
        the epoch is aborted before `inner` completes (for a waiter in C++, which the
        sliced waits cannot reach). CPU works only: a CUDA future carries stream
        events that a plain future would drop."""
        guarded = _GuardedFuture(inner)
        with self._cond:
            aborted = self._reason
            if aborted is None:
                self._guarded = [g for g in self._guarded if not g.done]
                self._guarded.append(guarded)
        if aborted is not None:
            guarded.abort(f"step aborted ({aborted})")
        return guarded.outer

    def fail(self, error: CollectiveError) -> None:
        """A collective of this rank failed: report it (once per epoch) and abort."""
        first = not self.is_set()
        if first and self.on_failure is not None:
            self.on_failure(error)  # aborts the epoch for every rank, via the store
        self.set(self.epoch, f"collective error: {error}")

    def wait_future(
        self,
        fut: Future[None],
        group: str,
        peer_machine: str | None,
        timeout_s: float | None = None,
    ) -> None:
        """Like `wait_work`, for a p2p work being waited by the `Waiter`."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            try:
                fut.result(timeout=POLL_S)
                return
            except FutureTimeout:
                pass
            except RuntimeError as exc:  # e.g. the peer's connection closed
                raise self._failed(group, peer_machine, str(exc).strip()[:500]) from None
            self._check(group, peer_machine, limit, deadline)

    def wait_work(
        self, work: Any, group: str, peer_machine: str | None, timeout_s: float | None = None
    ) -> None:
        """Waits for `work` unless the epoch is aborted (StepAborted) or the work fails or
        takes longer than the timeout (CollectiveError, after aborting the epoch)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            try:
                work.wait(_POLL)
                return
            except RuntimeError:
                if work.is_completed():  # finished since, or failed: a plain wait tells
                    try:
                        work.wait()
                        return
                    except RuntimeError as exc:  # e.g. the peer's connection closed
                        raise self._failed(group, peer_machine, str(exc).strip()[:500]) from None
            self._check(group, peer_machine, limit, deadline)

    def _check(self, group: str, peer_machine: str | None, limit: float, deadline: float) -> None:
        """Between two polls of a wait: StepAborted once the epoch is aborted, a
        CollectiveError (aborting the epoch) past the deadline."""
        if self.is_set():
            raise StepAborted(f"{group}: step aborted ({self.reason})")
        now = time.monotonic()
        if now > deadline:
            raise self._failed(group, peer_machine, f"no progress in {limit:.0f}s")
        if self.on_wait is not None:
            self.on_wait(now - (deadline - limit))

    def _failed(self, group: str, peer_machine: str | None, reason: str) -> CollectiveError:
        """The error of a failed wait, with the epoch aborted for every other wait."""
        error = CollectiveError(group, peer_machine, reason)
        self.fail(error)
        return error
