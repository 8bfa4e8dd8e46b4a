"""The downtime benchmark's runtime floor and ablations: the worker runtime alone, over
`LocalJob` (`"control_plane": "runtime"`), no services in the way; TrainMover itself is
measured through the services (`services_runs`).

One job is kept alive across repetitions. Each event hits the machine that serves cell
(dp 0, pp 0): a planned migration moves it to a standby and is measured with
`trainmover.runtime.bench.measure` (downtime per docs/glossary.md, phases, group build
time). The floor's standbys are warm (shadow iterations, run while the job is held: on
2 shared cores they would otherwise slow training, and in production a standby is
another machine).

Variants of the planned migration: the full system (`delta`: the leaver's groups only,
phase 1 overlapped with training, warm joiner), `full_rebuild` (every group of the
job), `no_overlap` (the job is held at the switch step while phase 1 builds the delta:
the build is on the critical path, as in stop-the-world setups) and `no_shadow` (a cold
joiner: its first real iteration pays the warm-up).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from trainmover.bench.memory import RssSampler
from trainmover.bench.settings import harness_timeout_s
from trainmover.localjob import LocalJob
from trainmover.logs import get_logger
from trainmover.runtime.bench import CELL, first_iterations, measure, step_end
from trainmover.runtime.config import JobConfig
from trainmover.runtime.launcher import REFERENCE_ENTRY
from trainmover.runtime.plan import RankRef
from trainmover.runtime.reports import MigrationReport
from trainmover.services.executor.switch import switch_step

Variant = Literal["delta", "full_rebuild", "no_overlap", "no_shadow"]
VARIANTS: tuple[Variant, ...] = ("delta", "full_rebuild", "no_overlap", "no_shadow")

log = get_logger("bench")


class TrainMoverJob:
    """A running job (the reference job, or the worker `entry` of an example) plus an
    RSS sampler of all its workers."""

    def __init__(
        self,
        config: JobConfig,
        run_dir: Path,
        standbys: int = 1,
        margin: int = 3,
        entry: str = REFERENCE_ENTRY,
    ):
        self.config, self.margin = config, margin
        self.job = LocalJob.launch(
            config,
            run_dir,
            standbys=standbys,
            limit=1,
            timeout_s=harness_timeout_s(config),
            entry=entry,
        )
        #: Standbys that ran shadow iterations (warmth cannot be undone: a cold joiner
        #: must be a standby never warmed).
        self.warmed: set[str] = set()
        self.sampler = RssSampler(
            lambda: {str(r): p.pid for r, p in list(self.job.procs.items()) if p.poll() is None}
        ).__enter__()

    def close(self) -> None:
        """Stops the job gracefully where it can. Its measurements are taken by now: a
        job that does not reach the stop step is logged with every rank's status and
        then killed, rather than failing the benchmark in its teardown."""
        self.sampler.__exit__()
        try:
            # Ahead of every rank (the limit may be far away after a free run).
            self.job.stop_at(self.job.current_step() + 2, timeout_s=120)
        except TimeoutError as err:
            try:
                statuses: dict[str, Any] = {
                    str(r): s.model_dump() for r, s in self.job.status().items()
                }
            except Exception as status_err:  # a hung rank may not answer either
                statuses = {"error": repr(status_err)}
            log.error("floor_stop_timed_out", error=str(err), ranks=statuses)
        finally:
            self.job.close()

    def __enter__(self) -> TrainMoverJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- steady state between events ---------------------------------------------------

    def hold(self) -> None:
        """Holds every rank at the next step boundary."""
        self.job.set_limit(self.job.current_step() + 1)
        self.job.wait_step(self.job.limit)

    def warm_standbys(self, machines: list[str]) -> None:
        """Shadow iterations on `machines`, for every role type (the job should be held:
        they share the cores)."""
        self.job.warm(machines)
        self.warmed.update(machines)

    def joiner(self, warm: bool) -> str | None:
        """The standby the next event uses: the first warm one (full system), or the
        first never warmed (no_shadow); None when there is none."""
        return next((m for m in self.job.standbys if (m in self.warmed) == warm), None)

    def settle(self, warm_steps: int, warm: bool = True) -> int:
        """Holds the job while a standby of the kind needed is started and (`warm`)
        warmed by shadow iterations (start-up and warm-up would disturb the step period
        on shared cores; in production they run on another machine), then trains
        `warm_steps` steady steps. Returns the first steady step."""
        if self.joiner(warm) is None:
            self.hold()
            self.job.add_standbys(1)
        self.job.wait_connected()
        if warm and self.joiner(True) is None:
            self.hold()
            cold = self.joiner(False)
            assert cold is not None
            self.warm_standbys([cold])
        steady_from = self.job.current_step() + 2
        self.job.set_limit(steady_from + warm_steps + 10 * self.margin + 50)
        self.job.wait_step(steady_from + warm_steps)
        return steady_from

    def leaver(self) -> str:
        return next(m for m, cell in self.job.assignment.items() if cell == CELL)

    # -- the measured events -----------------------------------------------------------

    def planned(self, variant: Variant, steady_from: int) -> dict[str, Any]:
        """One planned migration of the (dp 0, pp 0) machine to a standby (a cold one
        for `no_shadow`, a warm one otherwise; `settle` provides it)."""
        joiner = self.joiner(warm=variant != "no_shadow")
        if joiner is None:
            raise RuntimeError(f"no standby for {variant}: settle first")
        moves = {self.leaver(): joiner}
        if variant == "no_overlap":
            report = self._stop_the_world(moves)
        else:
            report = self.job.migrate(moves, margin=self.margin, full=variant == "full_rebuild")
        self.job.set_limit(max(self.job.limit, report.commit_step + 2))
        row = measure(self.job, report, steady_from, report.commit_step)
        row["mode"] = variant
        row["control_plane"] = "runtime"
        row["warm_joiner"] = joiner in self.warmed
        row["joiner_first_iteration_s"] = first_iterations(self.job, report)
        row["memory_mib"] = self._memory(report, steady_from)
        return row

    def _stop_the_world(self, moves: dict[str, str]) -> MigrationReport:
        """The no-overlap ablation: every rank is held at the switch step, then phase 1
        builds the delta while nobody trains, then the commit and the switch."""
        k = switch_step([self.job.current_step()], self.margin)  # the executor's choice
        self.job.set_limit(k)
        self.job.wait_step(k)
        return self.job.migrate(moves, at_step=k)

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
