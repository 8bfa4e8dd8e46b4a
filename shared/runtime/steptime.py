"""How long a step computed: the straggler signal, measured on the training thread.

A step's *compute time* is its wall time less

- the time the thread waited: on collectives, point-to-point works and the commit vote
  (a rank that waits for a slow peer is not slow itself), and
- the time the operating system kept the thread runnable but not running, its
  *run-queue delay* (``/proc/thread-self/schedstat``, second field), outside those waits
  (a rank queued behind other processes for a CPU is not computing slowly either).

The second part matters wherever ranks of several machines share a host (the local
cluster runs every machine on one): a burst of CPU load there (a released leaver
relaunching as a standby imports torch and runs shadow iterations right after a
migration) left some ranks queued for tens of seconds, and their wall-clock compute time
read 5-10x their CPU time while the others' did not, which the straggler detector took
for stragglers. Real slowness of a machine (a slower device, extra work, I/O, the
fault injection's sleep) is not run-queue delay and stays in.

Where the kernel does not report run-queue delay (not Linux, schedstats unavailable),
it reads as zero and compute time is wall time less waits, as before.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any


class SchedStat:
    """The schedstat file of one thread of this process (by default the one that opens
    it). A descriptor of /proc/thread-self stays bound to that thread, and re-reading it
    (~3 us) is far cheaper than opening it each time (~40 us). Closed when the thread ends
    (its thread-local slot goes) or the object does."""

    def __init__(self, native_id: int | None = None) -> None:
        self.fd: int | None = None
        own = native_id is None
        tid = threading.get_native_id() if native_id is None else native_id
        for path in (["/proc/thread-self/schedstat"] if own else []) + [
            f"/proc/self/task/{tid}/schedstat"
        ]:
            try:
                self.fd = os.open(path, os.O_RDONLY)
                break
            except OSError:
                continue

    def run_queue_s(self) -> float:
        if self.fd is None:
            return 0.0
        try:
            return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            self.close()
            return 0.0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


class _PerThread(threading.local):
    schedstat: SchedStat | None = None


_own = _PerThread()


def run_queue_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU since it
    started; 0.0 where the kernel does not say."""
    if _own.schedstat is None:
        _own.schedstat = SchedStat()
    return _own.schedstat.run_queue_s()


#: Thread id -> its schedstat file, kept open for `process_run_queue_s` (re-reading an
#: open descriptor costs a few microseconds, opening one tens, and a beacon sums every
#: thread of its process four times a second).
_THREADS: dict[int, SchedStat] = {}
_THREADS_LOCK = threading.Lock()


def process_run_queue_s() -> float:
    """Seconds all live threads of this process have spent runnable but waiting for a
    CPU (summed); 0.0 where the kernel does not say. A rank waiting in a collective has
    its training thread asleep: whether the data it waits for is being delivered shows in
    the run-queue delay of the library's I/O threads, not in the training thread's."""
    try:
        tids = {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return 0.0
    total = 0.0
    with _THREADS_LOCK:
        for tid in set(_THREADS) - tids:
            _THREADS.pop(tid).close()  # the thread ended
        for tid in tids:
            stat = _THREADS.get(tid)
            if stat is None:
                stat = _THREADS[tid] = SchedStat(tid)
            total += stat.run_queue_s()
            if stat.fd is None:  # could not be read: the thread ended meanwhile
                del _THREADS[tid]
    return total


#: Thread id -> how many waits it is inside now (read by other threads: the progress
#: beacon tells whether the training thread waits in a collective).
_INSIDE: dict[int, int] = {}
#: Thread id -> the ranks ("machine/local_rank") its innermost group wait waits on.
_ON: dict[int, tuple[str, ...]] = {}


class WaitClock(threading.local):
    """Per-thread totals: seconds spent waiting, and the run-queue delay inside those
    waits (already part of the waiting). Per thread, so a wait on another thread never
    counts against the training thread's step."""

    def __init__(self) -> None:
        self.waited_s = 0.0
        self.queued_s = 0.0

    def waiting(self, on: tuple[str, ...] = ()) -> _Waiting:
        """Counts the enclosed block as waiting (also when it raises), once however
        deeply waits nest; `on` names the ranks a group wait waits on (the progress board
        tells who holds whom)."""
        return _Waiting(self, on)

    @staticmethod
    def is_waiting(thread_id: int) -> bool:
        """Whether thread `thread_id` is inside a wait now (from any thread)."""
        return _INSIDE.get(thread_id, 0) > 0

    @staticmethod
    def waiting_on(thread_id: int) -> tuple[str, ...]:
        """The ranks thread `thread_id`'s current wait waits on (empty: none named)."""
        return _ON.get(thread_id, ()) if WaitClock.is_waiting(thread_id) else ()


#: Every wait of the runtime goes through this clock.
WAITS = WaitClock()


class _Waiting:
    """One wait of `WaitClock.waiting`: a plain context manager, as it encloses every
    collective's wait (a generator-based one costs several times more)."""

    __slots__ = ("_clock", "_on", "_me", "_depth", "_outer", "_started", "_queued")

    def __init__(self, clock: WaitClock, on: tuple[str, ...]) -> None:
        self._clock, self._on = clock, on

    def __enter__(self) -> None:
        IN_FLIGHT.observe()  # the works this wait may be for are seen done before it
        self._started, self._queued = time.perf_counter(), run_queue_s()
        self._me = me = threading.get_ident()
        self._depth = depth = _INSIDE.get(me, 0)
        _INSIDE[me] = depth + 1
        self._outer = _ON.get(me, ())
        _ON[me] = self._on

    def __exit__(self, *exc: object) -> None:
        me = self._me
        _INSIDE[me] -= 1
        _ON[me] = self._outer
        if self._depth == 0:  # an inner wait's time is part of this one's
            clock = self._clock
            clock.waited_s += time.perf_counter() - self._started
            clock.queued_s += run_queue_s() - self._queued


@dataclass
class InFlightSpan:
    """One tracked work's span; `dropped` before its completion, it is not counted."""

    started: float
    dropped: bool = False


class InFlightClock:
    """Works that a library waits for itself (DDP's reducer waits for its all-reduces in
    C++, out of the runtime's reach): each one's span from posting to completion. Time
    covered by such spans counts as waiting, so a rank held back by a slow peer's late
    all-reduce is not taken for slow itself; it slightly overstates waiting where a span
    overlaps the backward pass it was posted in, which only flatters the peers of a slow
    machine, never the slow machine (its own works complete at once).

    A span ends when the rank's own thread next sees its work complete: at its next
    post, wait (`WAITS`) or step end, and no later than the step's vote, a wait. A
    completion callback would time it exactly, but it runs on the backend's thread and
    takes the interpreter lock from the training thread at every collective, which cost
    more than the rest of a collective's bookkeeping together."""

    #: Works watched at most at once; beyond it the oldest are dropped (abandoned works
    #: of an aborted step may never complete).
    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[tuple[InFlightSpan, Any]] = []
        self._spans: list[tuple[float, float]] = []

    def track(self, future: Any) -> InFlightSpan:
        """Times a c10d work from now to the completion of its `future`, unless the
        returned span is `dropped` first (a work the runtime waits itself: WAITS times
        that). Without a future the work is only waited by the runtime."""
        self.observe()
        span = InFlightSpan(time.perf_counter())
        if future is not None:
            with self._lock:
                self._open.append((span, future))
                del self._open[: -self.LIMIT]
        return span

    def observe(self) -> None:
        """Ends the spans of the works seen complete now; forgets the dropped ones."""
        if not self._open:
            return
        now = time.perf_counter()
        with self._lock:
            still = []
            for span, future in self._open:
                if span.dropped:
                    continue
                if future.done():
                    self._spans.append((span.started, now))
                else:
                    still.append((span, future))
            self._open = still

    def covered(self, start: float, end: float) -> float:
        """Seconds of [start, end] inside some span; forgets spans that ended before
        `start` (steps are measured in order)."""
        self.observe()
        with self._lock:
            self._spans = [sp for sp in self._spans if sp[1] > start]
            spans = sorted((max(a, start), min(b, end)) for a, b in self._spans if a < end)
        total, reach = 0.0, start
        for a, b in spans:
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total


def future_of(work: Any) -> Any:
    """A c10d work's future (a `torch.futures.Future`; this module does not import
    torch); None where the backend gives it none (gloo's reduce-scatters, point-to-point
    works)."""
    try:
        return work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return None


#: Every c10d work posted for a library goes through this clock.
IN_FLIGHT = InFlightClock()


@dataclass(frozen=True)
class StepTime:
    """One step as measured: wall time, waiting, run-queue delay outside the waits, and
    the compute time that is left."""

    seconds: float
    waited_s: float
    queued_s: float

    @property
    def compute_s(self) -> float:
        return max(0.0, self.seconds - self.waited_s - self.queued_s)


class StepTimer:
    """Measures one step; create it on the training thread when the step starts."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._queued = run_queue_s()
        self._waited = WAITS.waited_s
        self._queued_waiting = WAITS.queued_s

    def stop(self) -> StepTime:
        now = time.perf_counter()
        seconds = now - self._started
        waited = WAITS.waited_s - self._waited + IN_FLIGHT.covered(self._started, now)
        queued = (run_queue_s() - self._queued) - (WAITS.queued_s - self._queued_waiting)
        return StepTime(seconds=seconds, waited_s=waited, queued_s=max(0.0, queued))
