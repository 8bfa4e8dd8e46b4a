"""The executor service: takes plans off the bus and runs each as a `Migration`.

Plans come from a durable JetStream consumer and are acked once their record is stored
in the executor's bucket; from then on the record, not the stream, is the truth. A
restarted executor resumes every unfinished record where it stopped, and a plan
delivered again after its record was stored (its ack was lost) runs from that record
unless it is running or over.

The executor also fences: a machine the planner declared failed, or a leaver of a
recovery, is told to kill its workers (`fencing`).

The executor follows the planner's cluster state: a plan the planner withdrew (it was in
the in-flight set and is no longer, unfinished: a recovery superseded it) is not started,
or is stopped where it is (record phase `withdrawn`), and the machines it left half way
are told to `abort` it: a joiner that may hold its role is relaunched as a standby, a
live leaver keeps its role. Every plan in a record was in the in-flight set before the
record existed (the planner stores a decision before publishing it), so a resumed
record whose plan is not in flight any more was withdrawn too.
"""

from __future__ import annotations

import asyncio
import hashlib

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from trainmover import bus, replication
from trainmover import metric_names as names
from trainmover.bus.clusterstate import StateStore
from trainmover.bushealth import BusHealth, degraded_gauge
from trainmover.logs import get_logger
from trainmover.messages import (
    ClusterState,
    Command,
    MessageError,
    MigrationProgress,
    Plan,
    decode,
)
from trainmover.metrics import Registry
from trainmover.planwire import plan_args
from trainmover.services.executor.fencing import Fence, to_fence
from trainmover.services.executor.migration import Migration, MigrationRecord
from trainmover.services.planner.cluster import role_holders
from trainmover.subjects import STATE_KEY, JobSubjects
from trainmover.tasks import cancel_and_wait

log = get_logger("executor")

RERUN_PAUSE_S = 1.0
"""How long a migration the bus interrupted waits before it goes on where it was."""


class ExecutorService:
    """One job's executor."""

    def __init__(
        self,
        nc: NatsClient,
        job: str,
        *,
        margin: int = 2,
        timeout_s: float = 120.0,
        groups_total: int | None = None,
        metrics: Registry | None = None,
        failure_grace_s: float = 10.0,
    ) -> None:
        """`failure_grace_s`: how long a migration whose machine's worker died waits for
        the planner to take it over with that machine's recovery before it fails."""
        self._nc = nc
        self._js = nc.jetstream()
        self.job = job
        self._subjects = JobSubjects(job)
        self.margin = margin
        self.timeout_s = timeout_s
        self.groups_total = groups_total
        self.failure_grace_s = failure_grace_s
        self._state_changed = asyncio.Condition()
        self._kv: KeyValue | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        self._records: dict[str, MigrationRecord] = {}
        # Plan ids ever seen in flight, and the in-flight set of the latest state.
        self._seen: set[str] = set()
        self._in_flight: set[str] | None = None
        self._last_state: ClusterState | None = None
        self._state_store: StateStore  # the job's state: set by start()
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics = metrics or Registry()
        self._m_migrations = self.metrics.counter(
            names.MIGRATIONS,
            "Migrations ended, by kind and outcome",
            ["kind", "outcome"],
        )
        self._m_downtime = self.metrics.histogram(
            names.MIGRATION_DOWNTIME,
            "Downtime of completed migrations",
            buckets=names.MIGRATION_DOWNTIME_BUCKETS,
        )
        self._m_phase = self.metrics.gauge(
            names.MIGRATION_PHASE, "Phase durations of the last migration", ["phase"]
        )
        self._bus_health = BusHealth("executor", degraded_gauge(self.metrics), [job])

    def health(self) -> dict[str, object]:
        connected = self._nc.is_connected
        return {
            "status": "ok" if connected and self._kv is not None else "starting",
            "job": self.job,
            "bus_connected": connected,
            "bus_degraded": self._bus_health.degraded,
            "running": sorted(self._running),
        }

    @property
    def running(self) -> set[str]:
        return set(self._running)

    async def start(self) -> None:
        await bus.ensure_job(self._js, self.job)
        self._tasks.append(asyncio.create_task(self._bus_health.watch(self._nc)))
        self._kv = await self._bucket()
        # One store for the follower and the reads: a read moves only the pieces of the
        # state that changed since the follower's last.
        self._state_store = StateStore(await bus.job_bucket(self._js, self.job))
        self._tasks.append(asyncio.create_task(self._follow_state(self._state_store)))
        await self._resume()
        sub = await self._js.pull_subscribe(
            self._subjects.plans,
            durable="executor",
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30
            ),
        )
        self._tasks.append(asyncio.create_task(self._pump(sub)))
        log.info("executor_started", job=self.job, resumed=sorted(self._running))

    async def stop(self) -> None:
        await cancel_and_wait([*self._tasks, *self._running.values()], owner="executor")

    async def _bucket(self) -> KeyValue:
        return await replication.key_value(self._js, self._subjects.executor_bucket, history=4)

    async def _resume(self) -> None:
        in_flight = await self._current_in_flight()
        for record in await bus.through_failover(self._stored, "records"):
            await self._pick_up(record, in_flight)

    async def _stored(self) -> list[MigrationRecord]:
        """Every migration record in the bucket. A listing that fails (a slow or electing
        server) raises: taken for an empty bucket, it would orphan the records."""
        kv = self._kv
        assert kv is not None
        records = []
        for key in await bus.bucket_keys(self._js, self._subjects.executor_bucket):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                continue
            if entry.value:
                records.append(decode(MigrationRecord, entry.value))
        return records

    async def _pump(self, sub: object) -> None:
        await bus.pump(sub, self._on_plan, job=self.job, consumer="executor", batch=8)

    async def _on_plan(self, msg: Msg) -> None:
        assert self._kv is not None
        try:
            plan = decode(Plan, msg.data)
        except MessageError as err:
            await bus.dead_letter(self._js, self.job, msg.subject, msg.data, str(err), "executor")
            await msg.ack()
            return
        key = f"migration.{plan.plan_id}"
        entry = await self._stored_record(key)
        if entry is not None and entry.value:
            # Redelivered: its record was stored, but the ack did not reach the server (the
            # handler failed there and bus.pump had the plan sent again). Not a duplicate
            # to drop: nothing may have launched it.
            await msg.ack()
            await self._pick_up(decode(MigrationRecord, entry.value), self._known_in_flight(plan))
            return
        record = MigrationRecord(plan=plan, groups_total=self.groups_total)
        await self._save(record)
        await msg.ack()
        log.info(
            "plan_accepted",
            job=self.job,
            plan_id=plan.plan_id,
            event_id=plan.event_id,
            migration=plan.migration,
            moves=[(m.leaver, m.joiner) for m in plan.moves],
        )
        await self._pick_up(record, self._known_in_flight(plan))

    async def _stored_record(self, key: str) -> KeyValue.Entry | None:
        """The migration record under `key`, or None. A plan waits on this read and on
        the record's first write: each attempt is short (`bus.ATTEMPT_S`)."""
        kv = self._kv
        assert kv is not None

        async def read() -> KeyValue.Entry | None:
            try:
                return await kv.get(key)
            except KeyNotFoundError:
                return None

        return await bus.through_failover(read, key, attempt_s=bus.ATTEMPT_S)

    def _known_in_flight(self, plan: Plan) -> set[str] | None:
        """The planner's in-flight plans, where they can tell whether `plan` was withdrawn:
        a plan not yet seen in flight may be newer than the latest state we follow."""
        if plan.plan_id not in self._seen:
            return None
        return self._in_flight or set()

    async def _pick_up(self, record: MigrationRecord, in_flight: set[str] | None) -> None:
        """Runs a stored migration that is not over and not running, unless the planner
        withdrew it (`in_flight`: its in-flight plans, None where unknown)."""
        plan_id = record.plan.plan_id
        if record.phase in ("done", "failed", "withdrawn") or plan_id in self._running:
            return
        if in_flight is not None and _withdrawn(record, in_flight):
            await self._withdraw(record, None)
            return
        log.info("migration_launched", job=self.job, plan_id=plan_id, phase=record.phase)
        self._launch(record)

    def _launch(self, record: MigrationRecord) -> None:
        plan_id = record.plan.plan_id
        if plan_id in self._running:
            return
        self._records[plan_id] = record
        task = asyncio.create_task(self._run(record))
        self._running[plan_id] = task
        task.add_done_callback(lambda _t: self._running.pop(plan_id, None))

    async def _run(self, record: MigrationRecord) -> None:
        plan_id = record.plan.plan_id
        migration = Migration(
            self._nc,
            record,
            self._save,
            self._publish,
            self._survivors,
            margin=self.margin,
            timeout_s=self.timeout_s,
            settle=lambda machine: self._settle(plan_id, machine),
        )
        while True:
            try:
                final = await migration.run()
                break
            except Exception as err:
                # A write that outlasted the bus's failover. The event must still get its
                # end: the migration goes on from where it was (its commands are
                # idempotent, its end is published again under the same message id).
                log.error(
                    "migration_interrupted",
                    job=self.job,
                    plan_id=plan_id,
                    phase=record.phase,
                    error=f"{type(err).__name__}: {err}",
                    exc_info=True,
                )
                await asyncio.sleep(RERUN_PAUSE_S)
        outcome = "done" if final.phase == "done" else "failed"
        self._m_migrations.labels(kind=final.plan.migration, outcome=outcome).inc()
        if outcome == "done":
            self._m_downtime.observe(final.phases.get("downtime", 0.0))
            for phase, seconds in final.phases.items():
                self._m_phase.labels(phase=phase).set(seconds)

    # --- plans the planner withdrew ----------------------------------------------------

    async def _settle(self, plan_id: str, machine: str) -> None:
        """Returns once the planner has declared `machine` failed, or after the grace. A
        recovery that takes the plan over withdraws it: then this never returns, and
        `_follow_state` cancels the waiting migration."""

        def acted() -> bool:
            state = self._last_state
            if state is None:
                return False
            status = getattr(state.machines.get(machine), "status", None)
            return status == "failed" or plan_id not in state.in_flight

        log.info("migration_settling", job=self.job, plan_id=plan_id, machine=machine)
        async with self._state_changed:
            try:
                await asyncio.wait_for(
                    self._state_changed.wait_for(acted), timeout=self.failure_grace_s
                )
            except TimeoutError:
                log.warning(
                    "failure_not_declared",
                    job=self.job,
                    plan_id=plan_id,
                    machine=machine,
                    grace_s=self.failure_grace_s,
                )
        state = self._last_state
        if state is not None and plan_id not in state.in_flight:
            # Withdrawn: `_follow_state` cancels this migration right after waking us; it
            # must publish nothing more (a "failed" would end the event a newer plan
            # carries on).
            await asyncio.Future()

    async def _current_in_flight(self) -> set[str] | None:
        stored = await self._state_store.read()
        if stored is None:
            return None  # no planner has run yet: nothing can have been withdrawn
        return set(stored.state.in_flight)

    async def _follow_state(self, store: StateStore) -> None:
        async for stored in store.follow():
            state = stored.state
            self._in_flight = set(state.in_flight)
            self._seen |= self._in_flight
            for fence in to_fence(self._last_state, state):
                self._tasks.append(asyncio.create_task(self._fence(fence)))
            self._last_state = state
            async with self._state_changed:
                self._state_changed.notify_all()
            for plan_id in list(self._running):
                record = self._records[plan_id]
                if plan_id in self._seen and _withdrawn(record, self._in_flight):
                    await self._withdraw(record, state)

    async def _withdraw(self, record: MigrationRecord, state: ClusterState | None) -> None:
        """Stops a withdrawn plan's migration and tells the machines it left half way."""
        plan = record.plan
        task = self._running.pop(plan.plan_id, None)
        if task is not None:
            if record.phase in ("done", "failed"):
                return  # it ended on its own; the planner dropped it for that reason
            await cancel_and_wait([task], owner="executor")
        record.phase = "withdrawn"
        await self._save(record)
        log.warning(
            "migration_withdrawn",
            job=self.job,
            plan_id=plan.plan_id,
            event_id=plan.event_id,
            moves=[(m.leaver, m.joiner) for m in plan.moves],
        )
        machines = state.machines if state is not None else {}
        # A joiner the planner sent to maintenance may hold its role; a live leaver of a
        # planned migration is active again. A dead machine just does not answer.
        targets = [
            m.joiner
            for m in plan.moves
            if getattr(machines.get(m.joiner), "status", "") == "maintenance"
        ]
        if plan.migration == "planned":
            targets += [
                m.leaver
                for m in plan.moves
                if getattr(machines.get(m.leaver), "status", "") == "active"
            ]
        for machine in targets:
            self._tasks.append(asyncio.create_task(self._abort_on(plan, machine)))

    async def _abort_on(self, plan: Plan, machine: str) -> None:
        command = Command(
            command_id=f"{plan.plan_id}.abort.{machine}",
            job=self.job,
            machine=machine,
            op="abort",
            plan_id=plan.plan_id,
            args={**plan_args(plan), "timeout_s": self.timeout_s},
        )
        try:
            reply = await bus.request(self._nc, command, timeout=30.0, deadline_s=self.timeout_s)
            error = reply.error if not reply.ok else None
        except Exception as err:  # the machine may be dead: nothing to undo there
            error = f"{type(err).__name__}: {err}"
        log.info("abort_sent", job=self.job, plan_id=plan.plan_id, machine=machine, error=error)

    async def _fence(self, fence: Fence) -> None:
        """Tells the machine's sidecar to kill its workers (`fencing`). A dead machine does
        not answer: the store refuses its workers whatever they do."""
        command = Command(
            command_id=fence.command_id,
            job=self.job,
            machine=fence.machine,
            op="fence",
            args={"instance": fence.instance},
        )
        try:
            reply = await bus.request(self._nc, command, timeout=5.0, deadline_s=30.0)
            result, error = reply.result, (reply.error if not reply.ok else None)
        except Exception as err:
            result, error = {}, f"{type(err).__name__}: {err}"
        log.warning(
            "machine_fenced" if result.get("fenced") else "fence_not_applied",
            job=self.job,
            machine=fence.machine,
            instance=fence.instance,
            result=result,
            error=error,
        )

    async def _survivors(self) -> list[str]:
        """The machines that keep their roles: active in the planner's cluster state."""

        async def read() -> ClusterState:
            stored = await self._state_store.read()
            assert stored is not None
            return stored.state

        state = await bus.through_failover(read, STATE_KEY, attempt_s=bus.ATTEMPT_S)
        return role_holders(state)

    async def _save(self, record: MigrationRecord) -> None:
        kv = self._kv
        assert kv is not None
        key = f"migration.{record.plan.plan_id}"
        await bus.through_failover(
            lambda: kv.put(key, record.to_json()), key, attempt_s=bus.ATTEMPT_S
        )

    async def _publish(self, progress: MigrationProgress) -> None:
        payload = progress.to_json()
        # Same state of the same plan for the same event -> same id: a resumed executor's
        # repeat is dropped (a plan that merged events reports to each of them).
        key = f"{progress.plan_id}.{progress.state}.{progress.event_id}"
        msg_id = hashlib.sha256(key.encode()).hexdigest()[:32]
        await bus.through_failover(
            lambda: self._js.publish(
                self._subjects.progress, payload, headers={"Nats-Msg-Id": msg_id}, timeout=5
            ),
            f"progress {key}",
        )
        log.info(
            "progress",
            job=self.job,
            plan_id=progress.plan_id,
            event_id=progress.event_id,
            state=progress.state,
            detail=progress.detail,
            downtime_s=progress.downtime_s,
        )


def _withdrawn(record: MigrationRecord, in_flight: set[str]) -> bool:
    """The planner dropped the plan before its switch. At `releasing` every rank has
    switched and the planner lets the plan go; its release still runs to its end."""
    return record.plan.plan_id not in in_flight and record.phase != "releasing"
