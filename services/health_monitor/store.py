"""Open incidents persisted in the job's health bucket, so a restart keeps its dedup.

Bucket TM_<job>_HEALTH (JetStream KV, file storage), one key per open incident:
`incident.<kind>.<machine>`. A record is written *before* its event is published and
marked published after the ack (an outbox): a monitor restarted between the two
re-publishes the event with the same id, and JetStream's duplicate window drops it if it
had gone out. The bucket is private to the health-monitor; the planner's cluster state
stays in TM_<job>.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ConfigDict, ValidationError

from trainmover import bus, replication
from trainmover.logs import get_logger
from trainmover.services.health_monitor.dedup import Incident
from trainmover.subjects import JobSubjects

log = get_logger("health-monitor")


class IncidentRecord(BaseModel):
    """An open incident and its event, as stored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str
    machine: str
    kind: str
    event_id: str
    source: str
    opened_ts: float
    published: bool
    event: str
    """The event's JSON, to re-publish after a crash between record and publish."""

    @property
    def incident(self) -> Incident:
        return Incident(
            self.job, self.machine, self.kind, self.event_id, self.source, self.opened_ts
        )


def record_key(kind: str, machine: str) -> str:
    return f"incident.{kind}.{machine}"


class IncidentStore:
    """The health bucket of one job."""

    def __init__(self, js: JetStreamContext, bucket: str, kv: KeyValue) -> None:
        self._js = js
        self._bucket = bucket
        self._kv = kv

    @classmethod
    async def open(cls, js: JetStreamContext, job: str) -> IncidentStore:
        bucket = JobSubjects(job).health_bucket
        return cls(js, bucket, await replication.key_value(js, bucket, history=1))

    async def load(self) -> list[IncidentRecord]:
        """Every stored record; an unreadable one is logged and dropped."""
        out = []
        for key in await bus.bucket_keys(self._js, self._bucket):
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                continue
            if not entry.value:
                continue
            try:
                out.append(IncidentRecord.model_validate_json(entry.value))
            except ValidationError as err:
                log.warning("incident_record_unreadable", key=key, error=str(err).splitlines()[0])
                await self._kv.delete(key)
        return out

    async def put(self, record: IncidentRecord) -> None:
        await self._kv.put(
            record_key(record.kind, record.machine), record.model_dump_json().encode()
        )

    async def delete(self, kind: str, machine: str) -> None:
        try:
            await self._kv.delete(record_key(kind, machine))
        except KeyNotFoundError:
            pass
