"""A service's view of its bus: degraded while two of three servers are down (the
streams lost their quorum, though its own server still answers core NATS), healthy
again once they are back; logged once each way and exported as a gauge."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import ClusterInfo, PeerInfo

from trainmover import bus
from trainmover.bushealth import BusHealth, BusState, degraded_gauge, has_quorum
from trainmover.metric_names import BUS_DEGRADED
from trainmover.metrics import Registry
from trainmover.natscluster import EmbeddedNatsCluster
from trainmover.subjects import JobSubjects, kv_stream


def _peer(current: bool = True, silent_s: float = 0.5, offline: bool | None = None) -> PeerInfo:
    return PeerInfo(name="n", current=current, offline=offline, active=int(silent_s * 1e9))


@pytest.mark.parametrize(
    ("cluster", "quorum"),
    [
        (None, True),
        (ClusterInfo(leader="n0"), True),  # one replica
        (ClusterInfo(leader="n0", replicas=[_peer(), _peer()]), True),
        (ClusterInfo(leader="n0", replicas=[_peer(), _peer(silent_s=9)]), True),
        (ClusterInfo(leader="n0", replicas=[_peer(silent_s=9), _peer(current=False)]), False),
        (ClusterInfo(leader="n0", replicas=[_peer(offline=True), _peer(silent_s=4)]), False),
        (ClusterInfo(leader=None, replicas=[_peer(), _peer()]), False),
    ],
)
def test_quorum_is_a_leader_and_a_majority_heard_from_lately(
    cluster: ClusterInfo | None, quorum: bool
) -> None:
    assert has_quorum(cluster) is quorum


def test_state_changes_once_each_way() -> None:
    state = BusState()
    assert [state.observe(ok, t) for t, ok in enumerate([True, False, False, True, True])] == [
        None,
        "degraded",
        None,
        "recovered",
        None,
    ]


async def test_quorum_loss_is_reported_and_its_end_too(
    running_cluster: EmbeddedNatsCluster, job: str
) -> None:
    # Connected to the state stream's leader, which keeps answering its info when cut off.
    setup = await bus.connect(running_cluster.url, "test-setup")
    try:
        await bus.ensure_job(setup.jetstream(), job)
        info = await setup.jetstream().stream_info(kv_stream(JobSubjects(job).bucket))
        assert info.cluster is not None and info.cluster.leader
        leader = running_cluster.nodes[running_cluster.index(info.cluster.leader)]
    finally:
        await setup.close()
    nc = await bus.connect(f"nats://127.0.0.1:{leader.port}", "test")
    registry = Registry()
    health = BusHealth("test", degraded_gauge(registry), [job], every_s=0.5)
    changes: asyncio.Queue[str] = asyncio.Queue()
    health.listeners.append(changes.put_nowait)
    watching = None
    try:
        watching = asyncio.create_task(health.watch(nc))
        connected = nc.connected_url.port  # type: ignore[union-attr]
        others = [i for i, n in enumerate(running_cluster.nodes) if n.port != connected]
        for index in others:
            await asyncio.to_thread(running_cluster.stop_node, index, True)
        assert await asyncio.wait_for(changes.get(), 30) == "degraded"
        assert nc.is_connected  # its own server is up: only JetStream lost its quorum
        assert health.degraded and registry.get_sample_value(BUS_DEGRADED) == 1.0
        for index in others:
            await asyncio.to_thread(running_cluster.start_node, index)
        assert await asyncio.wait_for(changes.get(), 60) == "recovered"
        assert not health.degraded and registry.get_sample_value(BUS_DEGRADED) == 0.0
    finally:
        if watching is not None:
            watching.cancel()
        await nc.close()
