"""Straggler detection, pure: a machine whose compute time stays above the job median.

Input is each active machine's compute time per step (time waiting in collectives
excluded, so a machine that waits for a slow peer does not look slow itself). For each
new step of machine m:

- the *job median* is the median, over the other active machines, of each one's median
  compute time over its last `window` steps (m itself is left out, so one straggler in a
  small job cannot drag the reference up);
- the step is *slow* when its compute time exceeds `factor` x the job median.

Warm-up: a machine's first `warmup` steps (since it was first seen) are history only.
Hysteresis: m is flagged after `consecutive` slow steps in a row (one slow step is
noise, not a straggler), and un-flagged only after `consecutive` normal steps in a row,
so a machine hovering at the threshold yields one event, not one per crossing.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from trainmover.messages import StragglerEvidence
from trainmover.services.health_monitor.median import SortedMedian

REORDER_STEPS = 8
"""A step this far behind the last one is a late report; further back, a new stream."""


@dataclass(frozen=True)
class StragglerFinding:
    """Machine `machine` of `job` was slow for `evidence.window` consecutive steps."""

    job: str
    machine: str
    first_slow_step: int
    step: int
    evidence: StragglerEvidence


@dataclass
class _History:
    times: deque[float]
    last_step: int = -1
    slow_run: deque[float] = field(default_factory=deque)
    slow_count: int = 0
    slow_since: int = -1
    normal_run: int = 0
    flagged: bool = False
    median: float | None = None  # of `times`, kept with it


class StragglerDetector:
    """Per-job rolling step statistics and the hysteresis state of every machine."""

    def __init__(
        self,
        factor: float = 1.5,
        consecutive: int = 5,
        window: int = 20,
        min_peers: int = 1,
        warmup: int = 10,
    ) -> None:
        if factor <= 1 or consecutive < 1 or window < 1 or min_peers < 1:
            raise ValueError(
                "straggler settings: factor > 1, consecutive >= 1, window >= 1, min_peers >= 1"
            )
        self.factor = factor
        self.consecutive = consecutive
        self.window = window
        #: Steps of a machine's history before its steps are judged at all.
        self.warmup = min(warmup, window)
        self.min_peers = min_peers
        self._jobs: dict[str, dict[str, _History]] = {}
        #: Per job, the medians of its machines' histories, sorted: the job median of
        #: each report is read from it, not recomputed over every machine.
        self._medians: dict[str, SortedMedian] = {}

    def forget(self, job: str, machine: str) -> None:
        """Drops a machine's history (it left, failed, or is not active any more)."""
        history = self._jobs.get(job, {}).pop(machine, None)
        if history is not None and history.median is not None:
            self._medians[job].remove(history.median)

    def machines(self, job: str) -> list[str]:
        return list(self._jobs.get(job, {}))

    def job_median(self, job: str, excluding: str | None = None) -> float | None:
        """Median over machines (but `excluding`) of their recent medians; None if too few."""
        medians = self._medians.get(job)
        if medians is None:
            return None
        history = self._jobs[job].get(excluding) if excluding is not None else None
        left_out = history.median if history is not None else None
        if len(medians) - (left_out is not None) < self.min_peers:
            return None
        return medians.median(excluding=left_out)

    def observe(
        self, job: str, machine: str, step: int, compute_s: float
    ) -> StragglerFinding | None:
        """Adds one step of one machine; returns a finding when it just became a straggler."""
        history = self._jobs.setdefault(job, {}).get(machine)
        if history is None:
            history = _History(times=deque(maxlen=self.window))
            self._jobs[job][machine] = history
        if step <= history.last_step:
            if history.last_step - step <= REORDER_STEPS:
                return None  # a repeated or reordered report says nothing new
            # The stream went back (a restart from a checkpoint, or steps believed that
            # never were): a new stream, whose slowness is judged afresh.
            history.slow_run.clear()
            history.slow_count = 0
            history.normal_run = 0
        history.last_step = step
        # The reference is taken before this step joins the history.
        reference = self.job_median(job, excluding=machine)
        warming_up = len(history.times) < self.warmup
        history.times.append(compute_s)
        median = statistics.median(history.times)
        self._medians.setdefault(job, SortedMedian()).replace(history.median, median)
        history.median = median
        if reference is None or reference <= 0 or warming_up:
            # A machine's first steps (lazy initialisation, a joiner's first iteration,
            # a job starting on a loaded host) say nothing about its speed.
            return None
        if compute_s > self.factor * reference:
            if not history.slow_count:
                history.slow_since = step
            history.slow_count += 1
            # Only the last `consecutive` slow times are evidence: memory stays bounded
            # however long the machine stays slow.
            history.slow_run.append(compute_s)
            if len(history.slow_run) > self.consecutive:
                history.slow_run.popleft()
            history.normal_run = 0
            if not history.flagged and history.slow_count >= self.consecutive:
                history.flagged = True
                run = list(history.slow_run)
                return StragglerFinding(
                    job=job,
                    machine=machine,
                    first_slow_step=history.slow_since,
                    step=step,
                    evidence=StragglerEvidence(
                        machine_median_s=statistics.median(run),
                        job_median_s=reference,
                        factor=self.factor,
                        window=self.consecutive,
                    ),
                )
            return None
        history.slow_run.clear()
        history.slow_count = 0
        history.normal_run += 1
        if history.flagged and history.normal_run >= self.consecutive:
            history.flagged = False
        return None

    def is_flagged(self, job: str, machine: str) -> bool:
        history = self._jobs.get(job, {}).get(machine)
        return bool(history and history.flagged)

    def evidence(self, job: str, machine: str) -> StragglerEvidence | None:
        """The case against a flagged machine as it stands now: the median of its last
        `consecutive` steps against the job median; None when it is not flagged."""
        history = self._jobs.get(job, {}).get(machine)
        reference = self.job_median(job, excluding=machine)
        if history is None or not history.flagged or not reference:
            return None
        recent = list(history.times)[-self.consecutive :]
        return StragglerEvidence(
            machine_median_s=statistics.median(recent),
            job_median_s=reference,
            factor=self.factor,
            window=len(recent),
        )
