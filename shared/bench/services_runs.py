"""TrainMover's side of the downtime and rebalance benchmarks through the product path: the
whole system of `trainmover up` (`LocalCluster`: embedded nats-server, planner,
executor, health-monitor, a sidecar per machine with its workers), driven the way a user
drives it.

- planned: a drain of the machine serving cell (dp 0, pp 0) through the client; the
  planner picks the joiner (a warm standby) and the delta, the executor runs the
  migration, and its final progress carries the downtime (docs/glossary.md) and phases;
- failure: SIGKILL of that machine's sidecar and every worker on it, mid-step; the
  health monitor detects it, the planner plans the recovery from the DP replica and the
  executor runs it. The killed machine is then started again: a fresh sidecar whose
  workers come back as a standby once warm.

Timings come from what the system publishes: the executor's migration progress (each
state stamped when it was entered) and the step statistics each sidecar stamps per
step, of a *witness* machine that never moves (the one serving the last cell: events
only hit cell (dp 0, pp 0)). Steps are synchronous across the job, so the witness's
step times are the job's. The asyncio side runs on a loop thread of its own, so that
the benchmark's blocking parts (the other systems) run between its events.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.msg import Msg

from trainmover.bench.settings import harness_timeout_s
from trainmover.localcluster import FAST_SIGNALS, LocalCluster
from trainmover.messages import ClusterState, MigrationProgress, decode
from trainmover.runtime.bench import CELL
from trainmover.runtime.config import JobConfig
from trainmover.runtime.launcher import REFERENCE_ENTRY
from trainmover.subjects import JobSubjects

CONTROL_PLANE = "services"
T = TypeVar("T")


def services_config(config: JobConfig, standbys: int, maintenance_s: float) -> JobConfig:
    """`config` with `standbys` standby machines (s0, s1, ...) and the time a drained
    machine stays in maintenance before it returns as a standby."""
    names = [f"s{i}" for i in range(standbys)]
    return config.with_updates(cluster={"standbys": names, "maintenance_s": maintenance_s})


class ServicesJob:
    """A running job under the whole system, with blocking calls for the benchmarks."""

    def __init__(
        self,
        config: JobConfig,
        workdir: Path,
        standbys: int = 1,
        maintenance_s: float = 5.0,
        entry: str = REFERENCE_ENTRY,
    ) -> None:
        self.config = services_config(config, standbys, maintenance_s)
        self.timeout_s = harness_timeout_s(config)
        self.witness = self.config.cluster.machines[-1]
        args = {k: list(v) for k, v in FAST_SIGNALS.items()}
        if entry != REFERENCE_ENTRY:
            args["sidecar"] = [*args.get("sidecar", []), "--entry", entry]
        # The services' logs go to files: the benchmark's progress is what a person reads.
        self.cluster = LocalCluster(
            self.config, workdir, service_args=args, log_dir=workdir / "logs"
        )
        #: Every migration progress seen, in arrival order (each is stamped by its sender).
        self.progress: list[MigrationProgress] = []
        self._held = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="services-job")
        self._thread.start()
        try:
            self._call(self._start())
        except BaseException:
            self._shutdown_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self) -> None:
        await self.cluster.__aenter__()
        subject = JobSubjects(self.config.job).progress
        await self.cluster.nc.subscribe(subject, cb=self._on_progress)
        # Training has started: the planner's cluster state exists from here on.
        await self.cluster.wait_step(self.witness, 1, self.timeout_s)

    async def _on_progress(self, msg: Msg) -> None:
        self.progress.append(decode(MigrationProgress, msg.data))

    def close(self) -> None:
        try:
            self._call(self.cluster.__aexit__(None, None, None))
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> ServicesJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the system published ---------------------------------------------------------

    def step_end(self, step: int) -> float:
        """When the witness's sidecar stamped `step`."""
        return self.cluster.step_ts[self.witness][step]

    def current_step(self) -> int:
        return self.cluster.steps.get(self.witness, 0)

    def wait_step(self, step: int) -> None:
        """Until the witness reported `step`."""
        self._call(self.cluster.wait_step(self.witness, step, self.timeout_s))

    def step_stamps(self) -> dict[int, float]:
        """step -> when the witness's sidecar stamped it."""
        return dict(self.cluster.step_ts.get(self.witness, {}))

    def normal_step(self, last: int, count: int = 20) -> float:
        """The median step period of the witness over up to `count` steps up to `last`."""
        ts = self.cluster.step_ts[self.witness]
        periods = [ts[s] - ts[s - 1] for s in range(last - count + 1, last + 1)
                   if s in ts and s - 1 in ts]  # fmt: skip
        if not periods:
            raise RuntimeError(f"no step period of {self.witness} up to step {last}")
        return statistics.median(periods)

    def steps_between(self, start: float, end: float) -> int:
        """Steps the witness finished inside [start, end]."""
        return sum(
            1 for ts in list(self.cluster.step_ts[self.witness].values()) if start < ts <= end
        )

    def stamps(self, event_id: str) -> dict[str, float]:
        """When each state of `event_id`'s migration was entered (its first report)."""
        out: dict[str, float] = {}
        for p in list(self.progress):
            if p.event_id == event_id:
                out.setdefault(p.state, p.ts)
        return out

    def cell_machine(self, state: ClusterState) -> str:
        return next(n for n, m in sorted(state.machines.items())
                    if m.status == "active" and m.cell == CELL)  # fmt: skip

    # -- steady state between events -------------------------------------------------------

    def settle(self, warm_steps: int, returned: bool = True) -> int:
        """Until no migration is in flight, a warm standby is free and (`returned`) every
        machine not active is a standby that has warmed (no start-up or shadow iterations
        left to disturb the step period on shared cores), then `warm_steps` more steps.
        Returns the first of those steps."""
        return self._call(self._settle(warm_steps, returned))

    async def _settle(self, warm_steps: int, returned: bool) -> int:
        names = {*self.config.cluster.machines, *self.config.cluster.standbys}

        def quiet(s: ClusterState) -> bool:
            others = [m for m in s.machines.values() if m.status != "active"]
            return (
                not s.in_flight
                and names <= set(s.machines)
                and any(m.status == "standby" and m.warm_role_types for m in others)
                and (
                    not returned or all(m.status == "standby" and m.warm_role_types for m in others)
                )
            )

        state = await self.cluster.wait_state(quiet, self.timeout_s)
        if state.machines[self.witness].status != "active":
            raise RuntimeError(f"the witness {self.witness} no longer trains")
        start = self.current_step() + 1
        await self.cluster.wait_step(self.witness, start + warm_steps, self.timeout_s)
        return start

    def hold(self) -> None:
        """Holds every active machine a few steps ahead (idle while other systems run)."""
        self._call(self.cluster.hold(self.timeout_s, margin=2))
        self._held = True

    def release(self) -> None:
        """Lets a held job train on (nothing to do for one never held)."""
        if self._held:
            self._call(self.cluster.release(self.timeout_s))
            self._held = False

    # -- the measured events ---------------------------------------------------------------

    def planned(self, steady_from: int) -> dict[str, Any]:
        """A drain of the machine of cell (dp 0, pp 0) through the client."""
        return self._call(self._planned(steady_from))

    async def _planned(self, steady_from: int) -> dict[str, Any]:
        client, job = self.cluster.client, self.config.job
        state = await client.status(job)
        leaver = self.cell_machine(state)
        warm = {n for n, m in state.machines.items() if m.status == "standby" and m.warm_role_types}
        step = self.current_step()
        normal = self.normal_step(step, max(2, step - steady_from))
        sent = time.time()
        event_id = await client.drain(job, leaver, reason="bench: planned migration")
        done = await client.wait_for_migration(job, event_id, timeout=self.timeout_s)
        if done.state != "done":
            raise RuntimeError(f"drain of {leaver} ended {done.state}: {done.detail}")
        # The witness's step periods across the migration: the largest is the switch.
        step = self.current_step()
        await self.cluster.wait_step(self.witness, step + 2, self.timeout_s)
        ts = self.cluster.step_ts[self.witness]
        gaps = [ts[s] - ts[s - 1] for s in range(steady_from + 1, step + 3)
                if s in ts and s - 1 in ts and ts[s] > sent]  # fmt: skip
        stamps = self.stamps(event_id)
        phases = {k: v for k, v in done.phases.items() if k != "downtime"}
        return {
            "control_plane": CONTROL_PLANE,
            "event_id": event_id,
            "leaver": leaver,
            "joiner": done.joiner,
            "warm_joiner": done.joiner in warm,
            "downtime_s": done.downtime_s,
            "witness_gap_s": max(gaps, default=normal) - normal,
            "normal_step_s": normal,
            "phases_s": phases,
            "drain_to_done_s": done.ts - sent,
            "groups_rebuilt": len(done.groups_rebuilt),
            "groups_total": done.groups_total,
            "joiner_first_iteration_s": done.phases.get("first_step"),
            "stamps": stamps,
        }

    def failure(self, steady_from: int) -> dict[str, Any]:
        """SIGKILL of the machine of cell (dp 0, pp 0) in the middle of a step: the system
        detects, plans and recovers by itself; the machine is started again after."""
        return self._call(self._failure(steady_from))

    async def _failure(self, steady_from: int) -> dict[str, Any]:
        cluster, job = self.cluster, self.config.job
        victim = self.cell_machine(await cluster.client.status(job))
        last = self.current_step() + 1
        await cluster.wait_step(self.witness, last, self.timeout_s)
        normal = self.normal_step(last, max(2, last - steady_from))
        # In the middle of the next step: the expected position of a random failure.
        await asyncio.sleep(max(0.0, self.step_end(last) + normal / 2 - time.time()))
        killed_at = time.time()
        cluster.stack.kill_machine(victim)
        state = await cluster.wait_state(
            lambda s: any(victim in p.leavers() for p in s.in_flight.values()), self.timeout_s
        )
        plan = next(p for p in state.in_flight.values() if victim in p.leavers())
        done = await cluster.client.wait_for_migration(job, plan.event_id, timeout=self.timeout_s)
        if done.state != "done":
            raise RuntimeError(f"recovery of {victim} ended {done.state}: {done.detail}")
        stamps = self.stamps(plan.event_id)
        # Every step stamped after the recovery began is a step of the recovered job.
        resumed = stamps.get("recovering", killed_at)
        _, first_end = await cluster.wait_step_after(self.witness, resumed, self.timeout_s)
        before = max(ts for ts in cluster.step_ts[self.witness].values() if ts < killed_at)
        await cluster.stack.start_machine(victim)  # a fresh machine, back as a standby
        phases = {k: v for k, v in done.phases.items() if k != "downtime"}
        phases["detect"] = stamps.get("planned", resumed) - killed_at
        return {
            "control_plane": CONTROL_PLANE,
            "event_id": plan.event_id,
            "dead": victim,
            "joiner": done.joiner,
            "downtime_s": first_end - killed_at,
            "end_to_end_s": done.downtime_s,
            "lost_in_flight_s": killed_at - before,
            "normal_step_s": normal,
            "phases_s": phases,
            "source": plan.migration,
        }
