"""The planner service: feeds events, progress and heartbeats to the decisions, durably.

Cluster state lives in the job's key-value bucket. Every decision is written there
*together with what it must publish* (an outbox) before anything is published; the outbox
is emptied after the publishes are acked. A planner killed at any point therefore
resumes from the bucket, republishes what it had decided (JetStream's duplicate window
drops the copies), and never decides the same event twice: event ids are remembered in
the state, and events are acked only after their decision is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from trainmover import bus
from trainmover import metric_names as names
from trainmover.bus.clusterstate import StateStore
from trainmover.bushealth import BusHealth, degraded_gauge
from trainmover.logs import get_logger
from trainmover.messages import (
    ClusterState,
    Heartbeat,
    MessageError,
    MigrationProgress,
    OutboxEntry,
    RebalanceEvent,
    StepStats,
    decode,
    decode_event,
)
from trainmover.metrics import Registry
from trainmover.runtime.config import JobConfig
from trainmover.services.planner.cluster import initial_state
from trainmover.services.planner.decisions import Outcome, Planner
from trainmover.services.planner.incarnation import InstanceCheck
from trainmover.services.planner.pool import RETURNING
from trainmover.subjects import STATE_KEY, JobSubjects
from trainmover.tasks import cancel_and_wait

log = get_logger("planner")


#: How often a stored but unsent outbox is sent again.
OUTBOX_RETRY_S = 2.0


class PlannerService:
    """One job's planner: consumers, state store, outbox, rebalance policy."""

    def __init__(
        self,
        nc: NatsClient,
        config: JobConfig,
        planner: Planner | None = None,
        rebalance_interval_s: float | None = None,
        metrics: Registry | None = None,
        open_bus: bool = False,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._config = config
        self._job = config.job
        self._subjects = JobSubjects(config.job)
        self._planner = planner or Planner(
            members=frozenset([*config.cluster.machines, *config.cluster.standbys])
        )
        self._refused: dict[str, str] = {}  # machine -> why its last heartbeat was turned away
        #: Heartbeats waiting for a decision (the newest of each machine), and their signal.
        self._beats: dict[str, Heartbeat] = {}
        self._beats_waiting = asyncio.Event()
        #: On an open bus, who may announce a machine's new instance (`incarnation`).
        self._instances = InstanceCheck(nc, config.job) if open_bus else None
        self._rebalance_interval_s = rebalance_interval_s
        self._kv: KeyValue | None = None
        self._store: StateStore | None = None
        self._state: ClusterState | None = None
        self._revision = 0
        self._lock = asyncio.Lock()
        self._compute: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=32))
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[object] = []
        self.metrics = metrics or Registry()
        self._m_decisions = self.metrics.counter(
            names.PLANNER_DECISIONS, "Inputs decided, by outcome", ["outcome"]
        )
        self._m_plans = self.metrics.counter(
            names.PLANNER_PLANS, "Plans published, by migration kind", ["kind"]
        )
        self._m_latency = self.metrics.histogram(
            names.PLANNER_PLAN_LATENCY, "Event publish to plan publish"
        )
        self._m_pool = self.metrics.gauge(names.STANDBY_POOL_SIZE, "Standby machines warm and free")
        self._bus_health = BusHealth("planner", degraded_gauge(self.metrics), [config.job])

    def health(self) -> dict[str, object]:
        connected = self._nc.is_connected
        loaded = self._state is not None
        return {
            "status": "ok" if connected and loaded else "starting",
            "job": self._job,
            "bus_connected": connected,
            "bus_degraded": self._bus_health.degraded,
            "revision": self._revision,
            "in_flight": len(self._state.in_flight) if self._state else 0,
        }

    @property
    def state(self) -> ClusterState:
        assert self._state is not None, "planner not started"
        return self._state

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._kv = await bus.ensure_job(self._js, self._job)
        self._store = StateStore(self._kv)
        await self._load()
        self._m_pool.set(self._pool_size())
        await self._flush_outbox()
        events = await self._js.pull_subscribe(
            self._subjects.events,
            durable="planner-events",
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30
            ),
        )
        progress = await self._js.pull_subscribe(
            self._subjects.progress,
            durable="planner-progress",
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30
            ),
        )
        # bus.subscribe: a subscription the bus refuses ends the start with its subject.
        self._subs.append(
            await bus.subscribe(self._nc, self._subjects.heartbeats, cb=self._on_heartbeat)
        )
        self._subs.append(
            await bus.subscribe(self._nc, self._subjects.all_stats, cb=self._on_stats)
        )
        self._tasks = [
            asyncio.create_task(self._bus_health.watch(self._nc)),
            asyncio.create_task(self._pump(events, self._on_event)),
            asyncio.create_task(self._pump(progress, self._on_progress)),
            asyncio.create_task(self._send_stored_outbox()),
            asyncio.create_task(self._decide_heartbeats()),
        ]
        if self._rebalance_interval_s:
            self._tasks.append(asyncio.create_task(self._rebalance_policy()))
        log.info(
            "planner_started",
            job=self._job,
            revision=self._revision,
            machines=len(self.state.machines),
            in_flight=len(self.state.in_flight),
        )

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, owner="planner")
        if self._instances is not None:
            await self._instances.close()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]

    async def _load(self) -> None:
        """The stored state, or a new one stored. Again through a leader election: a
        bucket just created on a cluster takes writes once its replicas elected one."""
        await bus.through_failover(self._load_once, f"{STATE_KEY} of {self._job}")

    async def _load_once(self) -> None:
        assert self._store is not None
        stored = await self._store.read()
        if stored is not None:
            self._state = stored.state
            self._revision = stored.revision
            log.info("state_resumed", job=self._job, revision=self._revision)
            return
        state = initial_state(self._config)
        try:
            self._revision = await self._store.write(state, last=None)
        except KeyWrongLastSequenceError:  # stored meanwhile (or our create's ack was lost)
            await self._load_once()
            return
        self._state = state
        log.info("state_created", job=self._job, machines=sorted(state.machines))

    def _pool_size(self) -> int:
        return sum(1 for m in self.state.machines.values() if m.status == "standby")

    async def _save(self, state: ClusterState) -> None:
        """Stores `state` if nobody else wrote since we read it (one planner per job)."""
        assert self._store is not None
        state = state.model_copy(update={"revision": state.revision + 1})
        try:
            self._revision = await self._store.write(state, last=self._revision)
        except KeyWrongLastSequenceError:
            log.error(
                "state_conflict",
                job=self._job,
                reason="another writer changed the cluster state; reloading",
            )
            await self._load()
            raise
        self._state = state
        self._m_pool.set(self._pool_size())

    # --- inputs ----------------------------------------------------------------------

    async def _pump(self, sub: object, handle: Callable[[Msg], Awaitable[None]]) -> None:
        await bus.pump(sub, handle, job=self._job, consumer="planner", recover=self._resync)

    async def _resync(self) -> None:
        """After a decision broke off (the bus went away): the stored state is the truth,
        and a stored but unsent outbox goes out before anything else is decided."""
        async with self._lock:
            await self._load()
            await self._flush_outbox()

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except MessageError as err:
            await bus.dead_letter(self._js, self._job, msg.subject, msg.data, str(err), "planner")
            await msg.ack()
            return
        if event.job != self._job:
            await bus.dead_letter(
                self._js,
                self._job,
                msg.subject,
                msg.data,
                f"event for job {event.job!r} on job {self._job!r}",
                "planner",
            )
            await msg.ack()
            return
        if msg.subject != self._subjects.event(event.kind):
            # Who may publish what is granted per subject (a client may not raise a
            # straggler): a payload must be of its subject's kind to be believed.
            await bus.dead_letter(
                self._js,
                self._job,
                msg.subject,
                msg.data,
                f"a {event.kind} event on {msg.subject}: events must come on "
                f"{self._subjects.event(event.kind)}",
                "planner",
            )
            await msg.ack()
            return
        if isinstance(event, RebalanceEvent) and event.machine is None:
            slowest = self._slowest()
            if slowest is not None:
                event = event.model_copy(update={"machine": slowest})
        await self._decide(
            lambda s: self._planner.on_event(s, event, time.time()),
            event_id=event.event_id,
            machine=event.machine,
            kind=event.kind,
        )
        self._m_latency.observe(max(0.0, time.time() - event.ts))
        await msg.ack()

    async def _on_progress(self, msg: Msg) -> None:
        try:
            progress = decode(MigrationProgress, msg.data)
        except MessageError as err:
            await bus.dead_letter(self._js, self._job, msg.subject, msg.data, str(err), "planner")
            await msg.ack()
            return
        await self._decide(
            lambda s: self._planner.on_progress(s, progress, time.time()),
            event_id=progress.event_id,
            plan_id=progress.plan_id,
        )
        await msg.ack()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = decode(Heartbeat, msg.data)
        except MessageError:
            return  # the health-monitor dead-letters bad heartbeats; one copy is enough
        if beat.job != self._job or msg.subject != self._subjects.heartbeat(beat.machine):
            return  # likewise: it names another machine than the subject it came on
        current = self.state.machines.get(beat.machine)
        if current is not None and current.status not in RETURNING + ("standby",):
            if not (beat.status == "active" and current.instance is None):
                return  # most heartbeats: a machine holding its role, already known
        outcome = self._planner.on_heartbeat(self.state, beat, time.time())
        if outcome.refused:
            if self._refused.get(beat.machine) != outcome.refused:
                if len(self._refused) > 4096:  # names come from the wire: stay bounded
                    self._refused.clear()
                self._refused[beat.machine] = outcome.refused
                log.warning(
                    "heartbeat_refused", job=self._job, machine=beat.machine, reason=outcome.refused
                )
            return
        returning = current is None or current.status in RETURNING
        if (
            self._instances is not None
            and returning
            and beat.status == "standby"
            and not self._instances.believed(beat, msg.data, msg.subject)
        ):
            return  # taken in with a heartbeat after its sidecar answered under it
        self._refused.pop(beat.machine, None)
        self._beats[beat.machine] = beat
        self._beats_waiting.set()

    async def _decide_heartbeats(self) -> None:
        """Decides the heartbeats `_on_heartbeat` kept, all those that came meanwhile in
        one decision (one state write). A large job's start admits a machine a heartbeat;
        a write each, awaited in the subscription's callback, held every heartbeat after
        it back until the bus dropped them (2,048 machines: tens of thousands dropped)."""
        while True:
            await self._beats_waiting.wait()
            self._beats_waiting.clear()
            beats, self._beats = list(self._beats.values()), {}
            try:
                await self._decide(
                    lambda s, beats=beats: admit_all(self._planner, s, beats, time.time()),
                    heartbeats=len(beats),
                    machine=beats[0].machine if len(beats) == 1 else None,
                )
            except Exception as err:  # the bus went away mid-write: decided again later
                log.warning(
                    "heartbeats_undecided", job=self._job, error=f"{type(err).__name__}: {err}"
                )
                for beat in beats:
                    self._beats.setdefault(beat.machine, beat)
                await asyncio.sleep(OUTBOX_RETRY_S)
                self._beats_waiting.set()

    async def _on_stats(self, msg: Msg) -> None:
        with contextlib.suppress(MessageError):
            stats = decode(StepStats, msg.data)
            self._compute[stats.machine].append(stats.compute_s)

    def _slowest(self) -> str | None:
        active = [n for n, m in self.state.machines.items() if m.status == "active"]
        timed = [(statistics.median(self._compute[n]), n) for n in active if self._compute[n]]
        return max(timed)[1] if timed else None

    async def _rebalance_policy(self) -> None:
        assert self._rebalance_interval_s is not None
        while True:
            await asyncio.sleep(self._rebalance_interval_s)
            slowest = self._slowest()
            if slowest is None:
                continue
            event = RebalanceEvent(
                job=self._job,
                machine=slowest,
                source="policy",
                reason=f"periodic rebalance every {self._rebalance_interval_s}s",
            )
            await bus.publish_durable(
                self._js, self._subjects.event("rebalance"), event, msg_id=event.event_id
            )

    # --- deciding and publishing -------------------------------------------------------

    async def _decide(self, rule: object, **context: object) -> None:
        async with self._lock:
            before = self.state
            outcome: Outcome = rule(before)  # type: ignore[operator]
            if outcome.state == before and not outcome.changed:
                # An input decided before, again (redelivered after its outputs failed to
                # go out): what it stored is sent now.
                await self._flush_outbox()
                return
            outbox = [*before.outbox, *_outbox_entries(outcome)]
            await self._save(outcome.state.model_copy(update={"outbox": outbox}))
            for p in outcome.progress:
                self._m_decisions.labels(outcome=p.state).inc()
                log.info(
                    "decision",
                    job=self._job,
                    state=p.state,
                    detail=p.detail,
                    leaver=p.leaver,
                    joiner=p.joiner,
                    **context,
                )
            for plan in outcome.plans:
                self._m_plans.labels(kind=plan.migration).inc()
            await self._flush_outbox()

    async def _send_stored_outbox(self) -> None:
        """Sends a stored outbox that no input will send: a decision whose publish failed
        (the bus went away), when nothing comes after it to decide again."""
        while True:
            await asyncio.sleep(OUTBOX_RETRY_S)
            if self._state is None or not self._state.outbox:
                continue
            try:
                async with self._lock:
                    await self._flush_outbox()
            except Exception as err:
                log.warning("outbox_retry", job=self._job, error=f"{type(err).__name__}: {err}")

    async def _flush_outbox(self) -> None:
        """Publishes every stored decision output; each has a stable id for dedup."""
        state = self.state
        if not state.outbox:
            return
        for entry in state.outbox:
            await self._js.publish(
                entry.subject,
                entry.payload.encode(),
                headers={"Nats-Msg-Id": entry.msg_id},
                timeout=5,
            )
        await self._save(state.model_copy(update={"outbox": []}))


def admit_all(planner: Planner, state: ClusterState, beats: list[Heartbeat], now: float) -> Outcome:
    """The heartbeats' decisions one after the other, as one outcome."""
    out = Outcome(state)
    for beat in beats:
        one = planner.on_heartbeat(out.state, beat, now)
        out = Outcome(
            one.state,
            plans=out.plans + one.plans,
            progress=out.progress + one.progress,
            cancelled=out.cancelled + one.cancelled,
        )
    return out


def _outbox_entries(outcome: Outcome) -> list[OutboxEntry]:
    subjects = JobSubjects(outcome.state.job)
    entries = []
    for plan in outcome.plans:
        entries.append(
            OutboxEntry(subject=subjects.plans, msg_id=plan.plan_id, payload=plan.model_dump_json())
        )
    for progress in outcome.progress:
        payload = progress.model_dump_json()
        msg_id = hashlib.sha256(payload.encode()).hexdigest()[:32]
        entries.append(OutboxEntry(subject=subjects.progress, msg_id=msg_id, payload=payload))
    return entries
