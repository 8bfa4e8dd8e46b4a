"""A machine named silent: starved of a CPU (excused) or stopped (believed), from the
readings its heartbeats carry. Pure verdicts on given readings, then the readings the
sidecar takes of a real process starved of its CPU, and then stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from trainmover.messages import WorkerStatus
from trainmover.services.health_monitor.starvation import (
    CpuEvidence,
    CpuReading,
    Excuses,
    starved,
)
from trainmover.services.sidecar import procstat


def reading(at: float, cpu: float, wait: float, runnable: int, pid: int = 7) -> CpuReading:
    return CpuReading(at=at, pid=pid, cpu_s=cpu, cpu_wait_s=wait, runnable_threads=runnable)


def worker(rank: int, cpu: float, wait: float, runnable: int, pid: int = 7) -> WorkerStatus:
    return WorkerStatus(local_rank=rank, pid=pid, state="running", cpu_s=cpu, cpu_wait_s=wait,
                        runnable_threads=runnable)  # fmt: skip


def test_runnable_threads_that_barely_ran_or_waited_long_are_starved() -> None:
    # Runnable and ran 0.05 s of 0.5 s: starved (its run-queue delay shows only once it runs).
    how = starved(0, reading(10.0, 3.0, 1.0, 1), reading(10.5, 3.05, 1.0, 1))
    assert how is not None and how.ran_s == pytest.approx(0.05) and how.interval_s == 0.5
    assert "local rank 0 waited 0.00s for a CPU and ran 0.05s in 0.50s" in str(how)
    # Its threads waited 0.3 s of 0.5 s for a CPU: starved, runnable now or not.
    assert starved(1, reading(10.0, 3.0, 1.0, 0), reading(10.5, 3.2, 1.3, 0)) is not None


def test_stopped_blocked_and_running_processes_are_not_starved() -> None:
    # Stopped (or blocked on a socket): nothing runnable, no waits, no CPU.
    assert starved(0, reading(10.0, 3.0, 1.0, 0), reading(10.5, 3.0, 1.0, 0)) is None
    # Spinning with the interpreter's lock held: runnable, and it runs.
    assert starved(0, reading(10.0, 3.0, 1.0, 1), reading(10.5, 3.4, 1.05, 1)) is None
    # A relaunched worker (another pid) compares with nothing.
    assert starved(0, reading(10.0, 3.0, 1.0, 1), reading(10.5, 3.0, 1.0, 1, pid=8)) is None


def test_evidence_speaks_only_fresh_and_only_when_every_asked_worker_was_starved() -> None:
    ev = CpuEvidence(fresh_s=1.0)
    ev.observe("j", "m1", [worker(0, 3.0, 1.0, 1), worker(1, 3.0, 1.0, 0)], at=10.0)
    assert ev.starved("j", "m1", [0], now=10.1) is None  # one reading: no interval yet
    ev.observe("j", "m1", [worker(0, 3.0, 1.0, 1), worker(1, 3.0, 1.0, 0)], at=10.5)
    found = ev.starved("j", "m1", [0], now=10.6)
    assert found is not None and [s.local_rank for s in found] == [0]
    assert ev.starved("j", "m1", [0, 1], now=10.6) is None  # local rank 1 was stopped
    assert ev.starved("j", "m1", [0], now=11.6) is None  # the last heartbeat is stale
    assert ev.starved("j", "m2", [0], now=10.6) is None  # nothing heard of m2
    # A worker whose heartbeat stops carrying readings (exited, unreadable) says nothing.
    ev.observe("j", "m1", [WorkerStatus(local_rank=0, pid=7, state="exited", exit_code=1)], 10.9)
    assert ev.starved("j", "m1", [0], now=11.0) is None
    ev.observe("j", "m1", [worker(1, 3.0, 1.0, 1)], at=11.0)
    ev.observe("j", "m1", [worker(1, 3.0, 1.0, 1)], at=11.5)
    assert ev.starved("j", "m1", [1], now=11.6) is not None
    ev.forget("j", "m1")  # settled by the planner (failed, in maintenance, removed)
    assert ev.starved("j", "m1", [1], now=11.6) is None


def test_an_excuse_is_counted_from_the_first_in_the_step_a_machine_holds_back() -> None:
    excuses = Excuses()
    assert excuses.held("j", "m1", "e0", 40, now=100.0) == 0.0
    assert excuses.held("j", "m2", "e0", 40, now=105.0) == 0.0  # each machine its own
    assert excuses.held("j", "m1", "e0", 40, now=112.5) == 12.5
    # The step moved on (it was starved, not hung): the next hold starts afresh.
    assert excuses.held("j", "m1", "e0", 41, now=130.0) == 0.0
    assert excuses.held("j", "m1", "e0", 41, now=131.0) == 1.0
    # So does a recovery's new epoch, at the same step.
    assert excuses.held("j", "m1", "e1", 41, now=140.0) == 0.0
    excuses.held("j", "m1", "e1", 41, now=141.0)
    excuses.forget("j", "m1")  # settled: back later as another machine's excuse
    assert excuses.held("j", "m1", "e1", 41, now=150.0) == 0.0


# --- the sidecar's readings of real processes --------------------------------------------

SPIN = "while True: pass"


@pytest.fixture
def spinners() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def spin(procs: list[subprocess.Popen[bytes]], cpu: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", SPIN])
    procs.append(p)
    os.sched_setaffinity(p.pid, {cpu})
    return p


def verdict(pid: int, interval_s: float = 0.5) -> object:
    """Two readings of `pid` as two heartbeats `interval_s` apart would carry them."""
    first = procstat.sample(pid)
    t0 = time.monotonic()
    time.sleep(interval_s)  # the interval between two heartbeats, not a synchronisation
    second = procstat.sample(pid)
    assert first is not None and second is not None
    at = time.monotonic() - t0
    return starved(0, reading(0.0, first.cpu_s, first.cpu_wait_s, first.runnable_threads, pid),
                   reading(at, second.cpu_s, second.cpu_wait_s, second.runnable_threads, pid))  # fmt: skip


def test_a_process_starved_of_a_cpu_reads_starved_and_a_stopped_one_does_not(
    spinners: list[subprocess.Popen[bytes]],
) -> None:
    cpu = min(os.sched_getaffinity(0))
    victim = spin(spinners, cpu)
    # Only idle time is left to the victim, and a spinner at normal priority on its one
    # CPU leaves none: the victim is runnable and waits, as behind an overloaded host's load.
    os.sched_setscheduler(victim.pid, os.SCHED_IDLE, os.sched_param(0))
    load = spin(spinners, cpu)
    assert verdict(victim.pid) is not None
    # Stopped (the load gone, so that it runs to take the signal): not starved.
    load.kill()
    victim.send_signal(signal.SIGSTOP)
    _, status = os.waitpid(victim.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status)
    assert verdict(victim.pid) is None
    assert procstat.sample(-1) is None  # no such process
