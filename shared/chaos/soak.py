"""`trainmover chaos`: a soak of random faults on the local cluster, with invariants.

For a fixed wall time and at most N faults, the soak injects a random (seeded, printed)
sequence of faults (trainmover.chaos.faults) into a TP2 x PP2 x DP2 job that trains until
it is stopped, each into a settled job (every standby warm, nothing in flight), so that
the training time a fault costs is its own. After each fault it waits for recovery (the
planner settled, the fault's machines gone from the layout, killed machines restarted as
fresh standbys) and checks:

- the job trains: every active machine goes past the step the job was at;
- at the next dump step every rank saved that step and data-parallel replicas are
  bit-identical (trainmover.chaos.invariants.check_replicas);
- standbys are accounted for (check_accounting, once the planner's view and the
  sidecars' heartbeats agree, within a deadline).

At the end it stops at a dump step F that every role saved and compares every common
dump step bit for bit with the same job and seed trained uninterrupted alongside the
soak (a `LocalJob` started with it, waited for until it passed F). The summary
gives faults injected and recovered, downtime per fault kind (training time lost in the
fault's window, and the executor's migration downtimes), and invariant violations.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from trainmover.chaos.faults import (
    INJECTORS,
    FaultContext,
    Injection,
)
from trainmover.chaos.invariants import check_accounting, check_replicas, dump_files
from trainmover.chaos.observer import Observer
from trainmover.chaos.report import (
    FaultRecord,
    SoakReport,
    SoakSettings,
    longest_stall,
    lost_text,
    lost_time,
    print_summary,
)
from trainmover.localcluster import FAST_SIGNALS, LocalCluster
from trainmover.localjob import LocalJob
from trainmover.logs import get_logger
from trainmover.messages import ClusterState
from trainmover.runtime.compare import mismatches, skipped_roles, state_files
from trainmover.runtime.config import JobConfig
from trainmover.runtime.layout import Layout

log = get_logger("chaos")

#: The job trains until the soak stops it; nothing in a run depends on `steps`.
ENDLESS = 100_000_000


def soak_config(dump_every: int, standbys: int = 2, layout: Layout | None = None) -> JobConfig:
    """The soak's job: the end-to-end job (on `layout`, by default TP2 x PP2 x DP2),
    training until stopped, dumping regularly."""
    return JobConfig(job="chaos", layout=layout or JobConfig().layout).with_updates(
        train={"steps": ENDLESS, "dump_every": dump_every},
        runtime={"group_timeout_s": 60, "failure_timeout_s": 60},
        cluster={"standbys": [f"s{i}" for i in range(standbys)], "maintenance_s": 1.0},
    )


#: The local cluster's fast signals, and a short straggler cool-down so the soak can
#: move a machine that joined a few faults ago.
SOAK_SIGNALS = {
    **FAST_SIGNALS,
    "planner": ["--straggler-cooldown", "20"],
    # The switch step is picked this many steps ahead of the furthest rank: on a host
    # this loaded the commit sometimes arrived after 2 steps ("too late").
    "executor": ["--margin", "5"],
}


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


class Soak:
    """One soak run; `run()` returns its report."""

    def __init__(self, settings: SoakSettings) -> None:
        self.s = settings
        self.seed = settings.seed if settings.seed is not None else random.randrange(2**31)
        self.rng = random.Random(self.seed)
        self.workdir = settings.workdir or Path(tempfile.mkdtemp(prefix="trainmover-chaos-"))
        self.config = soak_config(settings.dump_every, settings.standbys, settings.layout)
        self.report = SoakReport(
            seed=self.seed,
            settings={
                **{k: v for k, v in asdict(settings).items() if k != "workdir"},
                "layout": settings.layout.label,
            },
            workdir=str(self.workdir),
        )
        self.returning: set[str] = set()  # machines on their way back to the pool
        self._restarted: set[str] = set()
        #: Returning machines seen failed or in maintenance: one of these that is
        #: standby, joining or active again has come back (possibly taken straight from
        #: the pool as a joiner before it was ever observed as a standby).
        self._away: set[str] = set()
        #: Machines failed by the system without being a fault's target (each reported
        #: once as a violation).
        self.unexpected: set[str] = set()
        self._checked_dump = 0

    async def run(self) -> SoakReport:
        t0 = time.monotonic()
        say(
            f"chaos soak: seed {self.seed}, {self.s.duration_s:.0f}s, at most "
            f"{self.s.max_faults} faults of {', '.join(self.s.kinds)}; workdir {self.workdir} "
            "(services' logs in soak/logs, workers' in soak/run/*/logs)"
        )
        # The uninterrupted reference trains alongside the soak (the same job and seed,
        # until told where to stop), so the comparison at the end does not wait for a
        # whole second run.
        reference = None
        if self.s.reference:
            reference = await asyncio.to_thread(
                LocalJob.launch, self.config, self.workdir / "reference", standbys=0, timeout_s=600
            )
        try:
            await self._soak_cluster(t0)
            if reference is not None and self.report.final_step:
                await self._compare_reference(reference)
        finally:
            if reference is not None:
                await asyncio.to_thread(reference.close)
        self.report.wall_s = time.monotonic() - t0
        return self.report

    async def _soak_cluster(self, t0: float) -> None:
        cluster = LocalCluster(
            self.config,
            self.workdir / "soak",
            service_args=SOAK_SIGNALS,
            nats_cluster=self.s.nats_cluster,
            # Two replicas of the store when it is among the faults (one is killed).
            store_replicas=2 if "store_kill" in self.s.kinds else 0,
            store_shards=self.s.store_shards,
            # Who failed a machine is in the services' logs: kept with the workers'.
            log_dir=self.workdir / "soak" / "logs",
        )
        async with cluster:
            observer = await Observer(cluster).start()
            ctx = FaultContext(cluster, observer, self.rng, self.s.recovery_timeout_s)
            try:
                await self._soak(ctx, t0)
                await self._finish(ctx)
            except Exception as err:  # report what happened so far, never a traceback only
                log.exception("soak_aborted")
                self.report.violations.append(f"soak aborted: {type(err).__name__}: {err}")
            finally:
                await observer.stop()

    # --- the loop ----------------------------------------------------------------------

    async def _soak(self, ctx: FaultContext, t0: float) -> None:
        obs = ctx.observer
        say("waiting for the job to train and the standbys to warm up")
        await self._until_settled(ctx, "a warm standby pool")
        await obs.until(self._trains_from(obs, 5), self.s.recovery_timeout_s, "step 5")
        # The soak's wall time counts from the first fault, not from the cluster's start.
        first = time.monotonic()
        say(f"training at step {obs.job_step}; injecting faults")
        index = 0
        while index < self.s.max_faults and time.monotonic() - first < self.s.duration_s:
            if self.s.in_order:
                kind = self.s.kinds[index % len(self.s.kinds)]
            else:
                kind = self.rng.choice(self.s.kinds)
            # Every fault starts from a settled job: the whole pool warm, nothing in flight.
            # The training time it costs is then its own, not the warm-up of a machine an
            # earlier fault sent back to the pool (on a shared host, that takes CPU from
            # training too).
            await self._until_settled(ctx, "a settled job with a warm pool")
            index += 1
            record = await self._one(ctx, index, kind, t0)
            self.report.faults.append(record)
            say(
                f"#{index} {kind} {record.target or ''}: "
                + ("recovered" if record.recovered else "NOT RECOVERED")
                + (f" in {record.recovery_s:.1f}s" if record.recovery_s else "")
                + lost_text(record)
                + (f"; VIOLATIONS {record.violations}" if record.violations else "")
            )
            if not record.recovered:
                break  # the cluster is in an unknown state: stop and report

    async def _one(self, ctx: FaultContext, index: int, kind: str, t0: float) -> FaultRecord:
        obs = ctx.observer
        before, step_s, t_inject = obs.last_step, obs.step_time(), time.monotonic()
        start_step = before[1]
        progress_before = len(obs.progress)
        record = FaultRecord(index, kind, None, "", round(t_inject - t0, 1), start_step)
        record.warm_standbys = _warm_standbys(await obs.state())
        try:
            injection = await INJECTORS[kind](ctx)
            record.target, record.detail = injection.target, injection.detail
            log.info("fault_injected", kind=kind, target=injection.target, detail=injection.detail)
            await obs.until(
                lambda: self._recovered(ctx, injection),
                self.s.recovery_timeout_s,
                f"recovery from {kind} on {injection.target}",
            )
            await self._restart_bus_nodes(ctx, injection)
            settled = obs.job_step
            await obs.until(
                self._trains_from(obs, settled + 2),
                self.s.recovery_timeout_s,
                f"training past step {settled + 2}",
            )
        except Exception as err:
            record.violations.append(f"#{index} {kind}: {type(err).__name__}: {err}")
            return record
        record.recovered = True
        record.recovery_s = round(time.monotonic() - t_inject, 2)
        if step_s:
            record.lost_s = lost_time(before, obs.last_step, step_s)
            record.stall_s = longest_stall(obs.timeline, before, step_s)
            record.queued_extra_s = obs.queued_extra(start_step + 1, obs.job_step)
        for p in obs.progress[progress_before:]:
            if p.state in ("done", "failed", "aborted", "retrying", "fallback"):
                record.migrations.append(f"{p.state}: {p.leaver} -> {p.joiner}: {p.detail}")
            if p.state == "done" and p.downtime_s is not None and p.joiner:
                record.migration_downtime_s.append(round(p.downtime_s, 3))
        record.violations += await self._invariants(ctx, f"#{index} {kind}")
        return record

    # --- recovery ----------------------------------------------------------------------

    @staticmethod
    async def _restart_bus_nodes(ctx: FaultContext, injection: Injection) -> None:
        """Brings the fault's killed bus servers back with their state."""
        for index in sorted(injection.bus_nodes):
            servers = ctx.cluster.stack.bus_cluster()
            await asyncio.to_thread(servers.start_node, index)
            await asyncio.to_thread(servers.wait_ready)
            log.info("bus_node_restarted", node=servers.name(index))

    async def _until_settled(self, ctx: FaultContext, what: str) -> None:
        """Until every standby of the pool is warm and nothing is in flight or queued."""

        async def settled() -> bool:
            state = await self._settle_returning(ctx)
            warm = _warm_standbys(state) >= self.s.standbys
            return warm and not state.in_flight and not state.queued

        await ctx.observer.until(settled, self.s.recovery_timeout_s, what)

    async def _settle_returning(self, ctx: FaultContext) -> ClusterState:
        """Restarts killed machines the planner let go; forgets machines back in the pool."""
        state = await ctx.observer.state()
        # A machine the system failed on its own (a wrong verdict, or collateral damage of
        # a fault) is repaired too, so the pool does not shrink for good; the accounting
        # check has reported it as a violation already.
        failed = {n for n, m in state.machines.items() if m.status == "failed"}
        self.unexpected |= failed - self.returning
        # A machine in maintenance returns by itself (a migration the system started on
        # its own, e.g. for a straggler it saw); it must be back by the end.
        self.returning |= failed | {
            n for n, m in state.machines.items() if m.status == "maintenance"
        }
        for name in sorted(self.returning):
            status = state.machines[name].status
            if status == "failed" and name not in self._restarted:
                ctx.cluster.stack.kill_machine(name)  # a worker kill leaves its sidecar up
                await ctx.cluster.stack.machines[name].wait()
                await ctx.cluster.stack.start_machine(name)
                self._restarted.add(name)
                log.info("machine_reprovisioned", machine=name)
            if status in ("failed", "maintenance"):
                self._away.add(name)
            elif status == "standby" or (status in ("joining", "active") and name in self._away):
                self.returning.discard(name)
                self._restarted.discard(name)
                self._away.discard(name)
        return state

    async def _recovered(self, ctx: FaultContext, injection: Injection) -> bool:
        self.returning |= injection.killed | injection.left
        state = await self._settle_returning(ctx)
        if state.in_flight or state.queued:
            return False
        if any(
            state.machines[m].status in ("active", "leaving", "joining") for m in injection.left
        ):
            return False
        ended = {
            p.event_id
            for p in ctx.observer.progress
            if p.state in ("done", "failed", "aborted", "rejected")
        }
        return all(e in ended for e in injection.events)

    def _trains_from(self, obs: Observer, step: int):  # type: ignore[no-untyped-def]
        async def check() -> bool:
            state = await obs.state()
            active = [n for n, m in state.machines.items() if m.status == "active"]
            return bool(active) and all(obs.steps.get(n, -1) >= step for n in active)

        return check

    # --- invariants ----------------------------------------------------------------------

    async def _invariants(self, ctx: FaultContext, label: str) -> list[str]:
        obs = ctx.observer
        out: list[str] = []
        every = self.s.dump_every
        dump = (obs.job_step // every + 1) * every
        try:  # every active machine past the dump step: every rank saved it
            await obs.until(
                self._trains_from(obs, dump + 1),
                self.s.recovery_timeout_s,
                f"training past dump step {dump}",
            )
        except TimeoutError as err:
            return [f"{label}: the job stopped training: {err}"]
        out += [f"{label}: {v}" for v in check_replicas(self.config, self._run_dir, dump)]
        out += self._unexpected_failures(label)
        self._checked_dump = dump
        last: list[str] = []

        async def accounted() -> bool:
            nonlocal last
            state = await self._settle_returning(ctx)
            last = check_accounting(self.config, state, obs.beats, self.returning)
            return not last

        try:
            await obs.until(accounted, 60.0, "standby accounting")
        except TimeoutError:
            out += [f"{label}: {v}" for v in last]
        return out

    def _unexpected_failures(self, label: str) -> list[str]:
        found, self.unexpected = sorted(self.unexpected), set()
        return [f"{label}: {name} was failed by the system, not by the soak" for name in found]

    @property
    def _run_dir(self) -> Path:
        return self.workdir / "soak" / "run"

    async def _finish(self, ctx: FaultContext) -> None:
        """Every machine back in the pool or training; then a final dump step."""
        obs = ctx.observer
        say("faults done; waiting for the pool to refill")
        last: list[str] = []

        async def refilled() -> bool:
            nonlocal last
            state = await self._settle_returning(ctx)
            last = check_accounting(self.config, state, obs.beats, self.returning)
            return not self.returning and not last

        try:
            await obs.until(refilled, self.s.recovery_timeout_s, "the pool to refill")
        except TimeoutError:
            self.report.violations += [f"end: {v}" for v in last] or [
                f"end: machines never came back: {sorted(self.returning)}"
            ]
        every = self.s.dump_every
        final = (obs.job_step // every + 1) * every
        await obs.until(
            self._trains_from(obs, final + 1),
            self.s.recovery_timeout_s,
            f"training past the final dump step {final}",
        )
        self.report.violations += [
            f"end: {v}" for v in check_replicas(self.config, self._run_dir, final)
        ]
        self.report.violations += self._unexpected_failures("end")
        self.report.final_step = final
        say(f"final dump step {final}")

    async def _compare_reference(self, reference: LocalJob) -> None:
        final = self.report.final_step
        assert final is not None
        say(f"waiting for the uninterrupted reference to reach step {final}")
        ref_dir = self.workdir / "reference"

        def reach() -> None:
            # Step final + 1 done: every rank passed the boundary after `final` (its dump).
            reference.set_limit(max(reference.limit, final + 1))
            reference.wait_step(final + 1, timeout_s=max(600.0, final * 2.0))

        await asyncio.to_thread(reach)
        steps = sorted(
            s
            for s in range(self.s.dump_every, final + 1, self.s.dump_every)
            if dump_files(self._run_dir, s)
        )
        differences: list[str] = []
        for step in steps:
            differences += [
                f"step {step}: {d}"
                for d in mismatches(
                    state_files(self._run_dir, step),
                    state_files(ref_dir, step),
                    skipped_roles(self._run_dir, step),
                )
            ]
        self.report.compared_steps = steps
        self.report.bitexact = not differences and final in steps
        self.report.violations += [f"reference: {d}" for d in differences[:20]]
        say(
            f"compared {len(steps)} dump steps with the reference: "
            + ("bit-identical" if self.report.bitexact else f"{len(differences)} differences")
        )


def _warm_standbys(state: ClusterState) -> int:
    return sum(1 for m in state.machines.values() if m.status == "standby" and m.warm_role_types)


def main(settings: SoakSettings, json_path: str | None) -> int:
    report = asyncio.run(Soak(settings).run())
    print_summary(report)
    if json_path:
        Path(json_path).write_text(report.to_json())
    ok = report.summary()["invariant_violations"] == 0 and report.bitexact is not False
    return 0 if ok else 1
