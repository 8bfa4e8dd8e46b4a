"""Streams, buckets and object stores get replicas from what the server reports (or
the setting), an existing stream with fewer replicas is scaled up, and a client given
every server's URL carries on when the one it talks to crashes."""

from __future__ import annotations

import asyncio

import pytest

from trainmover import bus, replication
from trainmover.messages import DrainEvent
from trainmover.natscluster import EmbeddedNatsCluster
from trainmover.natsserver import EmbeddedNats
from trainmover.subjects import JobSubjects


async def _replicas(js, stream: str) -> int:  # type: ignore[no-untyped-def]
    return (await js.stream_info(stream)).config.num_replicas or 1


async def test_cluster_resources_get_three_replicas(
    running_cluster: EmbeddedNatsCluster, job: str
) -> None:
    nc = await bus.connect(running_cluster.url, "test")
    try:
        assert replication.server_cluster(nc) == "trainmover-local"
        js = nc.jetstream()
        await bus.ensure_job(js, job)
        subjects = JobSubjects(job)
        for stream in subjects.streams:
            assert await _replicas(js, stream) == 3, stream
        assert await _replicas(js, f"KV_{subjects.bucket}") == 3
        await replication.key_value(js, subjects.executor_bucket, history=4)
        assert await _replicas(js, f"KV_{subjects.executor_bucket}") == 3
        await replication.object_store(js, subjects.records_bucket)
        assert await _replicas(js, f"OBJ_{subjects.records_bucket}") == 3
    finally:
        await nc.close()


async def test_fewer_replicas_are_raised_never_lowered(
    running_cluster: EmbeddedNatsCluster, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    nc = await bus.connect(running_cluster.url, "test")
    js = nc.jetstream()
    events = JobSubjects(job).stream("EVENTS")
    try:
        monkeypatch.setenv(replication.REPLICAS_ENV, "1")
        await bus.ensure_job(js, job)
        assert await _replicas(js, events) == 1
        monkeypatch.delenv(replication.REPLICAS_ENV)
        await bus.ensure_job(js, job)  # the default on a cluster: 3
        assert await _replicas(js, events) == 3
        assert await _replicas(js, f"KV_{JobSubjects(job).bucket}") == 3
        monkeypatch.setenv(replication.REPLICAS_ENV, "1")
        await bus.ensure_job(js, job)
        assert await _replicas(js, events) == 3
    finally:
        await nc.close()


async def test_standalone_server_gets_one_replica(nats_url: str, job: str) -> None:
    nc = await bus.connect(nats_url, "test")
    try:
        assert replication.server_cluster(nc) is None
        await bus.ensure_job(nc.jetstream(), job)
        assert await _replicas(nc.jetstream(), JobSubjects(job).stream("EVENTS")) == 1
    finally:
        await nc.close()


async def test_more_replicas_than_servers_is_a_clear_error(
    job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(replication.REPLICAS_ENV, "3")
    with EmbeddedNats() as server:
        nc = await bus.connect(server.url, "test")
        try:
            with pytest.raises(replication.ReplicationError, match="3 replicas"):
                await bus.ensure_job(nc.jetstream(), job)
        finally:
            await nc.close()


def test_replica_setting_is_checked() -> None:
    assert replication.configured({}) is None
    assert replication.configured({replication.REPLICAS_ENV: "5"}) == 5
    for bad in ("0", "6", "three"):
        with pytest.raises(replication.ReplicationError, match=replication.REPLICAS_ENV):
            replication.configured({replication.REPLICAS_ENV: bad})


async def test_client_carries_on_when_its_server_crashes(
    running_cluster: EmbeddedNatsCluster, job: str
) -> None:
    nc = await bus.connect(running_cluster.url, "test")
    js = nc.jetstream()
    subjects = JobSubjects(job)
    try:
        await bus.ensure_job(js, job)
        before = DrainEvent(job=job, machine="m1")
        await bus.publish_durable(js, subjects.event("drain"), before, msg_id=before.event_id)
        connected = nc.connected_url.port  # type: ignore[union-attr]
        index = next(i for i, n in enumerate(running_cluster.nodes) if n.port == connected)
        running_cluster.stop_node(index, kill=True)
        after = DrainEvent(job=job, machine="m2")
        # Reconnects to another server; the stream keeps a quorum of 2 of 3.
        ack = await bus.publish_durable(
            js, subjects.event("drain"), after, msg_id=after.event_id, timeout=20
        )
        assert ack.seq == 2 and not ack.duplicate
        assert nc.connected_url.port != connected  # type: ignore[union-attr]
        info = await js.stream_info(subjects.stream("EVENTS"))
        assert info.state.messages == 2
    finally:
        await nc.close()


async def test_services_creating_a_job_together_all_start(
    running_cluster: EmbeddedNatsCluster, job: str
) -> None:
    clients = [await bus.connect(running_cluster.url, f"service-{i}") for i in range(3)]
    try:
        # The planner, executor and health-monitor of a job start together.
        await asyncio.wait_for(
            asyncio.gather(*(bus.ensure_job(nc.jetstream(), job) for nc in clients)), 30
        )
        for stream in JobSubjects(job).streams:
            assert await _replicas(clients[0].jetstream(), stream) == 3
    finally:
        for nc in clients:
            await nc.close()
