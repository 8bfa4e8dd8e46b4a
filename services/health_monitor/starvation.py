"""Whether a machine's workers were starved of a CPU, pure: the evidence its heartbeats
carry, weighed when a stall report names the machine silent.

A silent rank (its beacon did not beat between the judge's two reads) is stopped, cut
off from the store, or alive but starved of a CPU on an overloaded host. Only the last
is no failure: a replacement would not help, and the rank trains on once it runs. Each
heartbeat carries its workers' CPU time, run-queue delay and runnable threads
(`trainmover.services.sidecar.procstat`); over the interval between a worker's last two
heartbeats, it was *starved* when its threads waited for a CPU at least `WAITED` of that
time, or when some were runnable and it ran less than `RAN` of it. A stopped process has
no runnable thread and waits for nothing; a process cut off sleeps on its sockets; one
spinning in native code with the interpreter's lock held uses its CPU: none is starved.

A machine is excused for `--starved-grace` seconds (`Excuses`) from its first excuse in
the step it holds back; past them its stall is believed: a machine that gets no CPU for
that long holds the job as a hung one does, and one on another host would not be starved.

Evidence counts only while fresh: the worker's last heartbeat arrived within `fresh_s`
(two heartbeat intervals, `FRESH_S` at least) before the judgement (a machine cut off
sends none, and the verdict is believed; its heartbeats' lapse names it too). Both live
in memory: a restarted monitor reads the evidence again from the next two heartbeats,
and a machine's grace starts again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trainmover.messages import WorkerStatus

#: How recent a heartbeat speaks for a judgement, at least: the judge's two reads are a
#: second apart (`trainmover.runtime.progress.GAP_BEATS` beats), and so is the silence.
FRESH_S = 1.0
#: Share of the interval a starved process's threads waited for a CPU, at least.
WAITED = 0.5
#: Share of the interval a starved process with runnable threads ran, at most.
RAN = 0.25


@dataclass(frozen=True)
class CpuReading:
    """One worker's CPU as one heartbeat reported it (`at`: when it arrived)."""

    at: float
    pid: int
    cpu_s: float
    cpu_wait_s: float
    runnable_threads: int

    @staticmethod
    def of(worker: WorkerStatus, at: float) -> CpuReading | None:
        if worker.pid is None or worker.cpu_s is None or worker.cpu_wait_s is None:
            return None
        return CpuReading(at, worker.pid, worker.cpu_s, worker.cpu_wait_s,
                          worker.runnable_threads or 0)  # fmt: skip


@dataclass(frozen=True)
class Starvation:
    """How a worker was starved over the interval between two of its heartbeats."""

    local_rank: int
    interval_s: float
    waited_s: float
    ran_s: float
    runnable_threads: int

    def __str__(self) -> str:
        return (
            f"local rank {self.local_rank} waited {self.waited_s:.2f}s for a CPU and ran "
            f"{self.ran_s:.2f}s in {self.interval_s:.2f}s ({self.runnable_threads} threads "
            "runnable)"
        )


def starved(local_rank: int, before: CpuReading, now: CpuReading) -> Starvation | None:
    """How the worker was starved between the two readings, or None if it was not."""
    interval = now.at - before.at
    if interval <= 0 or now.pid != before.pid:
        return None
    waited = max(0.0, now.cpu_wait_s - before.cpu_wait_s)
    ran = max(0.0, now.cpu_s - before.cpu_s)
    if waited >= WAITED * interval or (now.runnable_threads > 0 and ran < RAN * interval):
        return Starvation(local_rank, interval, waited, ran, now.runnable_threads)
    return None


@dataclass
class CpuEvidence:
    """The last two readings of each worker of each machine, and what they say."""

    fresh_s: float
    _readings: dict[tuple[str, str, int], tuple[CpuReading | None, CpuReading]] = field(
        default_factory=dict
    )

    def observe(self, job: str, machine: str, workers: list[WorkerStatus], at: float) -> None:
        for worker in workers:
            reading = CpuReading.of(worker, at)
            key = (job, machine, worker.local_rank)
            if reading is None:
                self._readings.pop(key, None)
                continue
            last = self._readings.get(key)
            self._readings[key] = (last[1] if last else None, reading)

    def starved(
        self, job: str, machine: str, local_ranks: Iterable[int], now: float
    ) -> list[Starvation] | None:
        """How each of `local_ranks`' workers was starved, or None unless every one was,
        by heartbeats arrived within `fresh_s` before `now`."""
        found = []
        for rank in sorted(set(local_ranks)):
            before, last = self._readings.get((job, machine, rank), (None, None))
            if before is None or last is None or now - last.at > self.fresh_s:
                return None
            how = starved(rank, before, last)
            if how is None:
                return None
            found.append(how)
        return found or None

    def forget(self, job: str, machine: str) -> None:
        """Drops a machine's readings (it left the watched machines)."""
        for key in [k for k in self._readings if k[:2] == (job, machine)]:
            del self._readings[key]


@dataclass
class Excuses:
    """Since when each machine has been excused in the step it holds back."""

    _first: dict[tuple[str, str], tuple[str, int, float]] = field(default_factory=dict)

    def held(self, job: str, machine: str, epoch: str, step: int, now: float) -> float:
        """Seconds since `machine` was first excused in (`epoch`, `step`), counting this
        excuse; 0 for the first one (another step, or epoch, starts the count again)."""
        first = self._first.get((job, machine))
        if first is None or first[:2] != (epoch, step):
            first = self._first[(job, machine)] = (epoch, step, now)
        return now - first[2]

    def forget(self, job: str, machine: str) -> None:
        self._first.pop((job, machine), None)
