"""The async client end to end against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import register_job, sample_state
from trainmover import bus
from trainmover.client import (
    MachineLeaving,
    MigrationTimeout,
    TrainMoverClient,
    UnknownJob,
    UnknownMachine,
)
from trainmover.messages import (
    DrainEvent,
    FailureEvent,
    MigrationProgress,
    QueuedEvent,
)
from trainmover.subjects import JobSubjects

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schemas"


@pytest.fixture
async def tm(nats_url):
    client = await TrainMoverClient.connect(nats_url)
    yield client
    await client.close()


async def _next(items, kind):
    async for item in items:
        if isinstance(item, kind):
            return item
    raise AssertionError("watch ended")


async def test_drain_is_published_watched_and_followed(tm, nc, job):
    await register_job(nc, job)
    async with tm.watch(job) as items:
        watcher = asyncio.create_task(_next(items, DrainEvent))
        event_id = await tm.drain(job, "m1", reason="driver update", deadline_s=300)
        seen = await asyncio.wait_for(watcher, 10)
    assert seen.event_id == event_id and seen.machine == "m1" and seen.deadline_s == 300

    # An executor reports the migration; the client sees the terminal state.
    js = nc.jetstream()
    for state in ("planned", "phase1", "done"):
        await bus.publish_durable(
            js,
            JobSubjects(job).progress,
            MigrationProgress(
                job=job,
                event_id=event_id,
                plan_id="p1",
                state=state,
                leaver="m1",
                joiner="s0",
                downtime_s=0.5 if state == "done" else None,
            ),
        )
    done = await tm.wait_for_migration(job, event_id, timeout=10)
    assert done.state == "done" and done.joiner == "s0" and done.downtime_s == 0.5


async def test_report_failure_returns_event_id(tm, nc, job):
    await register_job(nc, job)
    event_id = await tm.report_failure(job, "m2", reason="ecc error")
    async with tm.watch(job, from_start=True) as items:
        event = await asyncio.wait_for(_next(items, FailureEvent), 10)
    assert event.event_id == event_id and event.source == "client"


async def test_status_returns_the_planner_state(tm, nc, job):
    state = sample_state(job, machines=4, standbys=2)
    await register_job(nc, job, state)
    assert await tm.status(job) == state


async def test_unknown_job_and_machine_are_clear_errors(tm, nc, job):
    with pytest.raises(UnknownJob, match="unknown job"):
        await tm.status(job)
    with pytest.raises(UnknownJob):
        await tm.drain(job, "m0")
    await register_job(nc, job)
    with pytest.raises(UnknownMachine, match=r"unknown machine 'm9'.*known: m0, m1"):
        await tm.drain(job, "m9")


async def test_drain_of_machine_already_leaving_is_refused(tm, nc, job):
    state = sample_state(job)
    machines = dict(state.machines)
    machines["m0"] = machines["m0"].model_copy(update={"status": "leaving"})
    await register_job(nc, job, state.model_copy(update={"machines": machines}))
    with pytest.raises(MachineLeaving, match="already leaving"):
        await tm.drain(job, "m0")
    # A failure of a leaving machine is still news: the planner switches paths.
    assert await tm.report_failure(job, "m0")


async def test_drain_of_machine_queued_to_leave_is_refused(tm, nc, job):
    state = sample_state(job, standbys=0)
    drain = DrainEvent(job=job, machine="m1")
    queued = QueuedEvent(event_id=drain.event_id, machine="m1", raw=drain.model_dump_json())
    await register_job(nc, job, state.model_copy(update={"queued": [queued]}))
    with pytest.raises(MachineLeaving, match="already queued to leave"):
        await tm.drain(job, "m1")


async def test_wait_for_migration_times_out_naming_where_the_migration_stands(tm, nc, job):
    await register_job(nc, job)
    with pytest.raises(MigrationTimeout, match="did not finish in 0.5s; no progress was published"):
        await tm.wait_for_migration(job, "no-such-event", timeout=0.5)
    subjects = JobSubjects(job)
    for state, detail in [("planned", "m0 -> s0"), ("phase1", "building the delta groups")]:
        progress = MigrationProgress(
            job=job, event_id="e1", plan_id="p1", state=state, detail=detail, ts=time.time() - 100
        )
        await nc.jetstream().publish(subjects.progress, progress.to_json())
    last = r"its last progress: phase1 of plan p1 \(building the delta groups\), 10[01]s ago"
    with pytest.raises(MigrationTimeout, match=last):
        await tm.wait_for_migration(job, "e1", timeout=0.5)


async def test_non_python_producer_follows_the_docs(nc, job):
    """A drain built as plain JSON (no pydantic), checked against the published schema."""
    await register_job(nc, job)
    raw = json.dumps(
        {
            "schema_version": 1,
            "kind": "drain",
            "event_id": "ops-42",
            "job": job,
            "machine": "m3",
            "reason": "kernel update",
            "deadline_s": 900,
            "source": "client",
            "ts": 1767225600.0,
        }
    ).encode()
    jsonschema.validate(json.loads(raw), json.loads((SCHEMAS / "drain_event.json").read_text()))
    ack = await nc.jetstream().publish(
        f"tm.{job}.events.drain", raw, headers={"Nats-Msg-Id": "ops-42"}
    )
    assert ack.stream == f"TM_{job}_EVENTS"
    client = TrainMoverClient(nc)
    async with client.watch(job, from_start=True) as items:
        event = await asyncio.wait_for(_next(items, DrainEvent), 10)
    assert event.event_id == "ops-42" and event.deadline_s == 900
