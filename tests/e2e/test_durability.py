"""The nats-server crashes in the middle of a migration: nothing accepted is lost.

JetStream keeps events, plans, progress and the cluster state in file storage; the
embedded server comes back on its port with its state directory and every process
reconnects. The migration in flight completes, an event acked just before the crash is
decided after it, each event is decided exactly once, and training ends bit-identical
to the uninterrupted reference.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from nats.js.api import DeliverPolicy

from tests.e2e.conftest import STEPS, WAIT_S, progress_reaches
from trainmover import bus
from trainmover.localcluster import LocalCluster as Cluster
from trainmover.messages import Command, DrainEvent, MigrationProgress, decode, decode_event
from trainmover.subjects import JobSubjects

pytestmark = pytest.mark.timeout(900)


async def _stream(cluster: Cluster, subject: str, stream: str) -> list[bytes]:
    """Every message the bus holds on `subject`, oldest first."""
    js = cluster.nc.jetstream()
    info = await js.stream_info(JobSubjects(cluster.job).stream(stream))
    if info.state.messages == 0:
        return []
    sub = await js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    out = []
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            out.append(msg.data)
            if msg.metadata.sequence.stream >= info.state.last_seq:
                return out
    finally:
        await sub.unsubscribe()


async def test_server_restart_mid_migration_loses_nothing(cluster: Cluster, reference) -> None:
    subjects = JobSubjects(cluster.job)
    await cluster.wait_step("m1", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)  # so each drain finds one
    # On a quiet host the remaining steps take seconds, less than the restarted server
    # and the services need to catch up: every machine sleeps 0.4 s more per step (no
    # change to the training result; all alike, so none looks like a straggler).
    for machine in ("m0", "m1", "m2", "m3"):
        slow = Command(job=cluster.job, machine=machine, op="slow", args={"extra_s": 0.4})
        reply = await bus.request(cluster.nc, slow)
        assert reply.ok, reply.error
    first = await cluster.client.drain(cluster.job, "m1", reason="before the crash")
    await asyncio.wait_for(progress_reaches(cluster, first, "phase1"), WAIT_S)
    # A second drain (of m2: m3 is a stayer of both, so it runs after the first) is
    # acked by the bus, and the server crashes at once, most likely before the planner
    # has fetched it.
    second = DrainEvent(job=cluster.job, machine="m2", reason="acked, then the crash")
    await bus.publish_durable(
        cluster.nc.jetstream(), subjects.event("drain"), second, msg_id=second.event_id
    )
    await cluster.stack.restart_bus(kill=True)

    for event_id in (first, second.event_id):
        done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
        assert done.state == "done", done.detail
    state = await cluster.wait_state(
        lambda s: not s.in_flight and s.machines["s1"].status == "active", WAIT_S
    )
    assert {state.machines[m].status for m in ("m1", "m2")} <= {"maintenance", "standby"}
    assert state.machines["s0"].status == "active"
    # Both migrations are behind: the stayers train at full speed to the end again (0
    # undoes the slow-down; the joiners never had it).
    for machine in ("m0", "m3"):
        fast = Command(job=cluster.job, machine=machine, op="slow", args={"extra_s": 0.0})
        reply = await bus.request(cluster.nc, fast)
        assert reply.ok, reply.error

    # A retried publish of the acked event after the restart is dropped as a duplicate.
    ack = await bus.publish_durable(
        cluster.nc.jetstream(), subjects.event("drain"), second, msg_id=second.event_id
    )
    assert ack.duplicate

    # Each event stored once, planned once, done once.
    events = [decode_event(raw) for raw in await _stream(cluster, subjects.events, "EVENTS")]
    stored = Counter(e.event_id for e in events)
    assert stored[first] == 1 and stored[second.event_id] == 1
    progress = [
        decode(MigrationProgress, raw)
        for raw in await _stream(cluster, subjects.progress, "PROGRESS")
    ]
    for event_id in (first, second.event_id):
        states = Counter(p.state for p in progress if p.event_id == event_id)
        assert states["planned"] == 1 and states["done"] == 1, states
    assert len({p.plan_id for p in progress if p.state == "done"}) == 2

    assert await cluster.wait_finished(WAIT_S) == ["m0", "m3", "s0", "s1"]
    assert cluster.mismatches(reference, STEPS) == []
