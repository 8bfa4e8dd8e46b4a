"""A step's compute time (the straggler signal): waits and run-queue delay are left out,
real extra work is not."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainmover.runtime.steptime import (
    IN_FLIGHT,
    WAITS,
    InFlightClock,
    StepTimer,
    process_run_queue_s,
    run_queue_s,
)

HAS_SCHEDSTAT = Path("/proc/thread-self/schedstat").exists()


def _burn(cpu_s: float) -> None:
    """Computes for `cpu_s` seconds of this thread's CPU time."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_waiting_is_left_out_and_sleeping_outside_waits_counts() -> None:
    timer = StepTimer()
    with WAITS.waiting():
        time.sleep(0.2)  # a collective: the peer is slow, not this rank
    time.sleep(0.2)  # this rank's own extra time (what `slow` injects)
    step = timer.stop()
    assert step.waited_s >= 0.2
    assert step.seconds >= 0.4
    assert 0.2 <= step.compute_s < step.seconds - 0.2 + 1e-6


def test_nested_waits_count_once() -> None:
    """A store operation inside the commit vote's wait is one wait, not two."""
    timer = StepTimer()
    with WAITS.waiting(), WAITS.waiting():
        time.sleep(0.2)
    step = timer.stop()
    assert 0.2 <= step.waited_s <= step.seconds + 1e-6


def test_a_wait_that_raises_still_counts_as_waiting() -> None:
    timer = StepTimer()
    with pytest.raises(RuntimeError), WAITS.waiting():
        time.sleep(0.1)
        raise RuntimeError("peer closed the connection")
    assert timer.stop().waited_s >= 0.1


def test_waits_on_another_thread_do_not_count_against_this_one() -> None:
    timer = StepTimer()

    def other() -> None:
        with WAITS.waiting():
            time.sleep(0.2)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert timer.stop().waited_s < 0.1


@pytest.mark.skipif(not HAS_SCHEDSTAT, reason="the kernel reports no run-queue delay here")
class _Future:
    """A work's future as the clock reads it: only `done()`."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


def test_a_work_a_library_waits_counts_until_the_rank_sees_it_complete() -> None:
    """A work posted for a library (DDP's all-reduce) counts as waiting from its post to
    the first wait of the rank that sees it complete; one the runtime waits itself
    (dropped) or one still running does not."""
    timer = StepTimer()
    library, runtime, running = _Future(), _Future(), _Future()
    IN_FLIGHT.track(library)
    IN_FLIGHT.track(runtime).dropped = True
    still = IN_FLIGHT.track(running)
    _burn(0.15)  # the rank computes while the work is in flight
    library.finished = runtime.finished = True
    with WAITS.waiting():  # the vote: the rank's next wait sees the work done
        pass
    _burn(0.1)  # after it: computing again
    step = timer.stop()
    assert 0.15 <= step.waited_s < step.seconds - 0.09
    still.dropped = True  # the clock is the process's: leave nothing in flight
    IN_FLIGHT.observe()


def test_the_in_flight_clock_forgets_what_it_need_not_keep() -> None:
    clock = InFlightClock()
    clock.LIMIT = 3
    futures = [_Future() for _ in range(5)]
    spans = [clock.track(f) for f in futures]
    assert len(clock._open) == 3  # the oldest dropped: abandoned works never complete
    spans[3].dropped = True
    futures[4].finished = True
    clock.observe()
    assert [f for _, f in clock._open] == [futures[2]]
    assert clock.covered(spans[4].started, spans[4].started + 3600) > 0
    assert clock.track(None).dropped is False and len(clock._open) == 1


def test_run_queue_delay_is_not_compute() -> None:
    """The training thread shares its one CPU with a busy process: its step takes about
    twice its CPU time, and the compute time is about the CPU time, not the wall time
    (before the fix it was the wall time, and a queued rank looked like a straggler)."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})  # this thread only
        before = run_queue_s()
        timer = StepTimer()
        cpu_started = time.thread_time()
        _burn(0.3)
        step = timer.stop()
        cpu_s = time.thread_time() - cpu_started
    finally:
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait()
    assert run_queue_s() > before
    # The hog got a fair share of the CPU, so this thread was queued for a good part.
    assert step.queued_s > 0.25 * step.seconds
    assert step.compute_s < 0.75 * step.seconds
    assert step.compute_s < 1.5 * cpu_s + 0.05
    assert step.compute_s == pytest.approx(step.seconds - step.queued_s)


@pytest.mark.skipif(not HAS_SCHEDSTAT, reason="the kernel reports no run-queue delay here")
def test_the_process_run_queue_delay_counts_threads_other_than_the_caller() -> None:
    """The caller sleeps while another thread of the process shares its one CPU with a
    busy process: the process's run-queue delay grows by that thread's, the caller's own
    does not (a rank asleep in a collective, its I/O thread queued)."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    queued: list[float] = []
    burnt, leave = threading.Event(), threading.Event()

    def worker() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        started = run_queue_s()
        _burn(0.3)
        queued.append(run_queue_s() - started)
        burnt.set()
        leave.wait()  # alive while the caller reads the sum

    thread = threading.Thread(target=worker)
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        mine, process = run_queue_s(), process_run_queue_s()
        thread.start()
        assert burnt.wait(60)
        mine, process = run_queue_s() - mine, process_run_queue_s() - process
    finally:
        leave.set()
        thread.join()
        hog.kill()
        hog.wait()
    assert queued[0] > 0.1  # the hog took a fair share of the CPU
    assert process >= queued[0]
    assert mine < queued[0] / 2
