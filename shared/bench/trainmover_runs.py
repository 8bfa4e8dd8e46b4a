"""TrainMover's side of the downtime and rebalance benchmarks, over `LocalJob`.

One job is kept alive across repetitions; each planned migration moves the machine that
serves cell (dp 0, pp 0) to a freshly started standby, and is measured with
`trainmover.runtime.bench.measure` (downtime per DESIGN.md, phases, group build time).
Variants: the full system (delta, phase 1 overlapped with training), `full_rebuild`
(every group of the job), `no_overlap` (the job is held at the switch step while phase 1
builds the delta: the build is on the critical path, as in stop-the-world setups).

Runtime part 2 plugs in here: `failure()` (kill a machine, recover from a DP replica)
and `planned(variant="no_shadow")` (the joiner skips its shadow iterations) raise
`NeedsRuntimePart2` until it is merged; the benchmarks record them as null + reason.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from trainmover.bench.memory import RssSampler
from trainmover.bench.report import NeedsRuntimePart2
from trainmover.runtime.bench import CELL, measure, step_end
from trainmover.runtime.config import JobConfig
from trainmover.runtime.driver import LocalJob, MigrationReport
from trainmover.runtime.plan import RankRef

Variant = Literal["delta", "full_rebuild", "no_overlap", "no_shadow"]
VARIANTS: tuple[Variant, ...] = ("delta", "full_rebuild", "no_overlap", "no_shadow")


class TrainMoverJob:
    """A running reference job plus an RSS sampler of all its workers."""

    def __init__(self, config: JobConfig, run_dir: Path, standbys: int = 1, margin: int = 3):
        self.config, self.margin = config, margin
        self.job = LocalJob.launch(config, run_dir, standbys=standbys, limit=1, timeout_s=600)
        self.sampler = RssSampler(
            lambda: {str(r): p.pid for r, p in list(self.job.procs.items()) if p.poll() is None}
        ).__enter__()

    def close(self) -> None:
        self.sampler.__exit__()
        try:
            # Ahead of every rank (the limit may be far away after a free run).
            self.job.stop_at(self.job.current_step() + 2, timeout_s=120)
        finally:
            self.job.close()

    def __enter__(self) -> TrainMoverJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- steady state between events ---------------------------------------------------

    def settle(self, warm_steps: int, add_standby: bool) -> int:
        """Holds the job while a new standby starts (its start-up would disturb the step
        period on shared cores; in production it is another machine), then trains
        `warm_steps` steady steps. Returns the first steady step."""
        if add_standby:
            self.job.set_limit(self.job.current_step() + 1)
            self.job.wait_step(self.job.limit)
            self.job.add_standbys(1)
        self.job.wait_connected()
        steady_from = self.job.current_step() + 2
        self.job.set_limit(steady_from + warm_steps + 10 * self.margin + 50)
        self.job.wait_step(steady_from + warm_steps)
        return steady_from

    def run_for(self, seconds: float) -> None:
        """Lets the job train freely for `seconds` (rebalance benchmark)."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            self.job.set_limit(self.job.current_step() + 1_000)
            time.sleep(min(1.0, max(0.0, deadline - time.time())))

    def leaver(self) -> str:
        return next(m for m, cell in self.job.assignment.items() if cell == CELL)

    # -- the measured events -----------------------------------------------------------

    def planned(self, variant: Variant, steady_from: int) -> dict[str, Any]:
        """One planned migration of the (dp 0, pp 0) machine to the next standby."""
        if variant == "no_shadow":
            raise NeedsRuntimePart2(
                "shadow iterations on standbys (issue 5); part 1 has none, so "
                "trainmover.planned_downtime_s is itself measured without them"
            )
        moves = {self.leaver(): self.job.standbys[0]}
        if variant == "no_overlap":
            report = self._stop_the_world(moves)
        else:
            report = self.job.migrate(moves, margin=self.margin, full=variant == "full_rebuild")
        self.job.set_limit(max(self.job.limit, report.commit_step + 2))
        row = measure(self.job, report, steady_from, report.commit_step)
        row["mode"] = variant
        row["memory_mib"] = self._memory(report, steady_from)
        return row

    def failure(self, steady_from: int) -> dict[str, Any]:
        """Unplanned: SIGKILL one worker of the (dp 0, pp 0) machine and recover from a
        DP replica onto a warm standby. Plug runtime part 2 in here: kill the leaver's
        process, let the driver's failure path (detection, abort of the stayers' blocked
        collectives, delta build on the critical path, transfer from the replica) run,
        and return `measure_failure(...)`: kill -> first step done after recovery, plus
        the discarded in-flight step (DESIGN.md's downtime for failures)."""
        raise NeedsRuntimePart2(
            "unplanned failure recovery from a DP replica (detection, abort, commit "
            "agreement); LocalJob of part 1 has no failure path"
        )

    def _stop_the_world(self, moves: dict[str, str]) -> MigrationReport:
        """The no-overlap ablation: hold every rank at the switch step, then build the
        delta (phase 1) while nobody trains, then commit and release."""
        job = self.job
        k = job.current_step() + self.margin
        resume = job.limit
        job.set_limit(k)
        job.wait_step(k)
        plan = job.make_plan(moves)
        prepare_sent = time.time()
        acks = job.prepare(plan)
        ready = job.wait_ready(plan)
        ready_at = commit_sent = time.time()
        job.commit(plan, k)
        commit_acked = time.time()
        job.set_limit(max(resume, k + 2))
        switched = job.wait_switched(plan)
        return MigrationReport(
            plan, k, prepare_sent, ready, ready_at, commit_sent, commit_acked, switched, acks
        )

    def _memory(self, report: MigrationReport, steady_from: int) -> dict[str, Any]:
        """Peak RSS of each part during the migration (phase 1 included: prepare sent ->
        first step after it) against its own steady state (the steady window before)."""
        job, plan = self.job, report.plan
        steady = (step_end(job, steady_from), report.prepare_sent)
        during = (report.prepare_sent, step_end(job, report.commit_step + 1))

        def peaks(machines: set[str], window: tuple[float, float]) -> dict[str, float]:
            refs = [
                str(RankRef(machine=m, local_rank=i))
                for m in sorted(machines)
                for i in range(job.layout.ranks_per_machine)
            ]
            found = {r: self.sampler.peak_mib(r, *window) for r in refs}
            return {r: v for r, v in found.items() if v is not None}

        def top(values: dict[str, float]) -> float | None:
            return max(values.values(), default=None)

        stayer_steady, stayer_during = peaks(plan.stayers(), steady), peaks(plan.stayers(), during)
        # Per rank: a stayer's peak during the migration minus its own steady peak.
        overhead = {
            r: stayer_during[r] - stayer_steady[r] for r in stayer_during if r in stayer_steady
        }
        return {
            "stayer_steady_peak": top(stayer_steady),
            "stayer_migration_peak": top(stayer_during),
            "stayer_overhead_max": top(overhead),
            "joiner_standby": top(peaks(plan.joiners(), steady)),
            "joiner_migration_peak": top(peaks(plan.joiners(), during)),
            "leaver_steady_peak": top(peaks(plan.leavers(), steady)),
            "leaver_migration_peak": top(peaks(plan.leavers(), during)),
        }
