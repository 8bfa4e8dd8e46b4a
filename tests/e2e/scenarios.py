"""End-to-end scenarios shared by the tests of a bus fault: what the bus holds, each
event decided exactly once, and a drain that runs through a fault of the bus."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

from nats.js.api import DeliverPolicy

from tests.e2e.conftest import WAIT_S, Reference, progress_reaches
from trainmover import bus
from trainmover.localcluster import LocalCluster
from trainmover.messages import Command, DrainEvent, MigrationProgress, decode, decode_event
from trainmover.subjects import JobSubjects


async def stream_messages(cluster: LocalCluster, subject: str, stream: str) -> list[bytes]:
    """Every message the bus holds on `subject`, oldest first; read again when a server
    of the bus cluster went away meanwhile."""
    js = cluster.nc.jetstream()

    async def read() -> list[bytes]:
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

    return await bus.through_failover(read, f"messages of {stream}")


async def assert_each_once(cluster: LocalCluster, event_ids: list[str]) -> None:
    """Each of `event_ids` stored once on the bus, planned once and done once, each
    migration under its own plan."""
    subjects = JobSubjects(cluster.job)
    events = [
        decode_event(raw) for raw in await stream_messages(cluster, subjects.events, "EVENTS")
    ]
    stored = Counter(e.event_id for e in events)
    assert all(stored[e] == 1 for e in event_ids), stored
    progress = [
        decode(MigrationProgress, raw)
        for raw in await stream_messages(cluster, subjects.progress, "PROGRESS")
    ]
    for event_id in event_ids:
        states = Counter(p.state for p in progress if p.event_id == event_id)
        assert states["planned"] == 1 and states["done"] == 1, states
    plans = {p.plan_id for p in progress if p.state == "done" and p.event_id in event_ids}
    assert len(plans) == len(event_ids)


async def drain_through_fault(
    cluster: LocalCluster,
    reference: Reference,
    fault: Callable[[], Awaitable[None]],
    repair: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """A drain of m1 in phase 1 and a second drain (of m2) just acked when `fault` hits
    the bus: both migrations complete (then `repair` runs), each event is decided
    exactly once, a retried publish is a duplicate, and training ends bit-identical to
    `reference` at the step it ends. The job's drained machines must stay in maintenance, so that the second
    drain's joiner is s1."""
    assert cluster.config.cluster.maintenance_s > WAIT_S, "m1 would return as a standby"
    subjects = JobSubjects(cluster.job)
    await cluster.wait_step("m1", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)  # so each drain finds one
    # On a quiet host the remaining steps take seconds, less than the restarted server
    # and the services need to catch up: every machine sleeps 0.4 s more per step (no
    # change to the training result; all alike, so none looks like a straggler). The
    # standbys too: a joiner keeps its workers, and so the slow-down, once it trains.
    for machine in ("m0", "m1", "m2", "m3", "s0", "s1"):
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
    await fault()

    for event_id in (first, second.event_id):
        done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
        assert done.state == "done", done.detail
    if repair is not None:
        await repair()
    state = await cluster.wait_state(
        lambda s: not s.in_flight and s.machines["s1"].status == "active", WAIT_S
    )
    assert {state.machines[m].status for m in ("m1", "m2")} <= {"maintenance", "standby"}
    assert state.machines["s0"].status == "active"
    # Both migrations are behind: the job trains at full speed to the end again (0
    # undoes the slow-down).
    for machine in ("m0", "m3", "s0", "s1"):
        fast = Command(job=cluster.job, machine=machine, op="slow", args={"extra_s": 0.0})
        reply = await bus.request(cluster.nc, fast)
        assert reply.ok, reply.error

    # A retried publish of the acked event after the restart is dropped as a duplicate.
    ack = await bus.publish_durable(
        cluster.nc.jetstream(), subjects.event("drain"), second, msg_id=second.event_id
    )
    assert ack.duplicate

    await assert_each_once(cluster, [first, second.event_id])

    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == ["m0", "m3", "s0", "s1"]
    assert cluster.mismatches(await reference(step), step) == []
