"""Turns decided events into durable publishes, once per incident.

`propose` is the single gate every event passes: it looks the (job, machine, kind) up
in the incident table and either folds the signal into the open incident (duplicate) or
opens a new incident and queues the event. One worker task then, in order, records the
incident in the job's health bucket, publishes the event durably with its id as
`Nats-Msg-Id`, and marks the record published; a failed publish is retried (the event is
never dropped; its repeats are already deduplicated). Closing incidents goes through the
same queue, so a record is never deleted before it was written.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from nats.js import JetStreamContext

from trainmover import bus
from trainmover.logs import get_logger
from trainmover.messages import DrainEvent, FailureEvent, StragglerEvent, decode_event
from trainmover.services.health_monitor.dedup import Incident, IncidentTable
from trainmover.services.health_monitor.metrics import HealthMetrics
from trainmover.services.health_monitor.store import IncidentRecord, IncidentStore
from trainmover.subjects import JobSubjects
from trainmover.tasks import cancel_and_wait

log = get_logger("health-monitor")

MonitorEvent = DrainEvent | FailureEvent | StragglerEvent
Outcome = Literal["emitted", "duplicate"]

#: The longest wait between two tries of an event's publish. A stream electing its
#: leader refuses at once, many times in a row; the event should go out within this of
#: the election's end (a failure event holds the job's recovery), and a try refused at
#: once costs the bus one small request.
RETRY_CAP_S = 0.25


@dataclass
class _Emit:
    event: MonitorEvent
    incident: Incident
    alive_ts: float | None
    done: asyncio.Future[None]
    republish: bool = False


@dataclass
class _Close:
    incident: Incident


class Emitter:
    """The incident table, its persistence, and the publishing worker."""

    def __init__(
        self,
        js: JetStreamContext,
        table: IncidentTable,
        metrics: HealthMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._js = js
        self.table = table
        self._metrics = metrics
        self._clock = clock
        self._stores: dict[str, IncidentStore] = {}
        self._queue: asyncio.Queue[_Emit | _Close] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._pending = 0

    @property
    def pending(self) -> int:
        """Events decided but not yet acked by the bus."""
        return self._pending

    async def add_job(self, job: str) -> None:
        """Opens the job's health bucket and restores its open incidents."""
        store = await IncidentStore.open(self._js, job)
        self._stores[job] = store
        now = self._clock()
        for record in await store.load():
            incident = record.incident
            if now - incident.opened_ts >= self.table.window_s:
                await store.delete(incident.kind, incident.machine)
                continue
            self.table.open(incident)
            log.info(
                "incident_restored",
                job=job,
                machine=incident.machine,
                kind=incident.kind,
                event_id=incident.event_id,
                published=record.published,
                reason="open incident from before the restart; its repeats stay duplicates",
            )
            if not record.published:
                # Crashed between recording and publishing: publish again with the same
                # id; JetStream drops it if the first attempt had reached the stream.
                event = decode_event(record.event)
                if isinstance(event, DrainEvent | FailureEvent | StragglerEvent):
                    self._enqueue_emit(event, incident, None, republish=True)
        self._metrics.open_incidents.set(len(self.table))

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run(), name="health-monitor-emitter")

    async def stop(self, timeout: float = 5.0) -> None:
        """Lets queued publishes finish (up to `timeout`), then stops the worker."""
        if self._worker is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout)
        await cancel_and_wait([self._worker], owner="health-monitor emitter")
        self._worker = None

    def open_incident(self, job: str, machine: str, kind: str) -> Incident | None:
        return self.table.active((job, machine, kind), self._clock())

    def propose(
        self, event: MonitorEvent, *, alive_ts: float | None = None
    ) -> tuple[Outcome, Incident, asyncio.Future[None] | None]:
        """Emits `event` unless its machine and kind already have an open incident.

        Returns the outcome, the incident (new, or the one it duplicates) and, for a new
        one, a future done when the bus acked the event. `alive_ts` (wall time of the
        last sign of life) feeds the detection-latency histogram.
        """
        key = (event.job, event.machine, event.kind)
        now = self._clock()
        existing = self.table.active(key, now)
        if existing is not None:
            self._metrics.duplicates.labels(
                job=event.job, kind=event.kind, source=event.source
            ).inc()
            log.debug(
                "event_duplicate",
                job=event.job,
                machine=event.machine,
                kind=event.kind,
                source=event.source,
                event_id=existing.event_id,
                reason=f"incident open since {now - existing.opened_ts:.1f}s "
                f"(window {self.table.window_s:g}s)",
            )
            return "duplicate", existing, None
        incident = Incident(event.job, event.machine, event.kind, event.event_id, event.source, now)
        for evicted in self.table.open(incident):
            log.warning(
                "incident_evicted",
                job=evicted.job,
                machine=evicted.machine,
                kind=evicted.kind,
                reason="incident table full",
            )
        self._metrics.open_incidents.set(len(self.table))
        log.info(
            "event_decided",
            job=event.job,
            machine=event.machine,
            kind=event.kind,
            source=event.source,
            event_id=event.event_id,
            reason=event.reason,
        )
        return "emitted", incident, self._enqueue_emit(event, incident, alive_ts)

    def _enqueue_emit(
        self,
        event: MonitorEvent,
        incident: Incident,
        alive_ts: float | None,
        republish: bool = False,
    ) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending += 1
        self._metrics.pending_publishes.set(self._pending)
        self._queue.put_nowait(_Emit(event, incident, alive_ts, done, republish))
        return done

    def settle(self, job: str, machine: str, why: str) -> list[Incident]:
        """Closes a machine's incidents: the planner acted (failed, maintenance, removed)."""
        closed = self.table.close_machine(job, machine)
        for incident in closed:
            log.info(
                "incident_closed",
                job=job,
                machine=machine,
                kind=incident.kind,
                event_id=incident.event_id,
                reason=why,
            )
            self._queue.put_nowait(_Close(incident))
        self._metrics.open_incidents.set(len(self.table))
        return closed

    def close(self, job: str, machine: str, kind: str, why: str) -> Incident | None:
        """Closes one incident (its event was answered), so the next event for the
        machine and kind is emitted, not taken for a repeat."""
        incident = self.table.close((job, machine, kind))
        if incident is not None:
            log.info(
                "incident_closed",
                job=job,
                machine=machine,
                kind=kind,
                event_id=incident.event_id,
                reason=why,
            )
            self._queue.put_nowait(_Close(incident))
            self._metrics.open_incidents.set(len(self.table))
        return incident

    def expire(self) -> None:
        """Closes incidents older than the dedup window (their machine may re-emit)."""
        for incident in self.table.expire(self._clock()):
            log.info(
                "incident_expired",
                job=incident.job,
                machine=incident.machine,
                kind=incident.kind,
                event_id=incident.event_id,
                reason=f"older than the dedup window of {self.table.window_s:g}s",
            )
            self._queue.put_nowait(_Close(incident))
        self._metrics.open_incidents.set(len(self.table))

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                if isinstance(item, _Emit):
                    await self._publish(item)
                else:
                    await self._close(item.incident)
            finally:
                self._queue.task_done()

    async def _close(self, incident: Incident) -> None:
        store = self._stores.get(incident.job)
        if store is None:
            return
        try:
            await store.delete(incident.kind, incident.machine)
        except Exception as err:  # a stale record only expires later; not worth a retry
            log.warning("incident_delete_failed", job=incident.job, error=str(err))

    def _count_published(self, event: MonitorEvent, item: _Emit) -> float | None:
        """Counts a published event; returns its detection latency, when it has one."""
        self._metrics.events.labels(job=event.job, kind=event.kind, source=event.source).inc()
        if item.alive_ts is None:
            return None
        latency = max(self._clock() - item.alive_ts, 0.0)
        self._metrics.detection_latency.labels(source=event.source).observe(latency)
        return latency

    async def _publish(self, item: _Emit) -> None:
        event, incident = item.event, item.incident
        store = self._stores.get(event.job)
        record = IncidentRecord(
            job=event.job,
            machine=event.machine,
            kind=event.kind,
            event_id=event.event_id,
            source=event.source,
            opened_ts=incident.opened_ts,
            published=False,
            event=event.model_dump_json(),
        )
        delay = 0.05
        latency: float | None = None
        while True:
            try:
                if store is not None and not item.republish:
                    await store.put(record)
                await bus.publish_durable(
                    self._js, JobSubjects(event.job).event(event.kind), event, msg_id=event.event_id
                )
                # Counted as soon as the bus has it, before anything else is awaited.
                latency = self._count_published(event, item)
                if store is not None:
                    await store.put(record.model_copy(update={"published": True}))
                break
            except Exception as err:  # bus trouble: keep the event, retry with backoff
                self._metrics.publish_errors.inc()
                log.warning(
                    "event_publish_retry",
                    job=event.job,
                    machine=event.machine,
                    event_id=event.event_id,
                    error=str(err) or type(err).__name__,
                    retry_in_s=delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_CAP_S)
        self._pending -= 1
        self._metrics.pending_publishes.set(self._pending)
        log.info(
            "event_published",
            job=event.job,
            machine=event.machine,
            kind=event.kind,
            source=event.source,
            event_id=event.event_id,
            detection_latency_s=None if latency is None else round(latency, 4),
        )
        if not item.done.done():
            item.done.set_result(None)
