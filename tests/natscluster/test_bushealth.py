"""A service's view of its bus: degraded while two of three servers are down (the
streams lost their quorum, though its own server still answers core NATS), healthy
again once they are back; logged once each way and exported as a gauge."""

from __future__ import annotations

import asyncio

from trainmover import bus
from trainmover.bushealth import BusHealth, BusState, degraded_gauge
from trainmover.metric_names import BUS_DEGRADED
from trainmover.metrics import Registry
from trainmover.natscluster import EmbeddedNatsCluster


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
    nc = await bus.connect(running_cluster.url, "test")
    registry = Registry()
    health = BusHealth("test", degraded_gauge(registry), [job], every_s=0.5)
    changes: asyncio.Queue[str] = asyncio.Queue()
    health.listeners.append(changes.put_nowait)
    watching = None
    try:
        await bus.ensure_job(nc.jetstream(), job)
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
