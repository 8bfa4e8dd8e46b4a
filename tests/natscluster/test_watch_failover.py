"""A watch opened while the bus has no quorum starts once the servers are back (its own
module: it takes two of the module cluster's three servers down)."""

from __future__ import annotations

import asyncio

from tests.conftest import register_job
from trainmover import bus
from trainmover.client import TrainMoverClient
from trainmover.natscluster import EmbeddedNatsCluster


async def test_a_watch_opened_without_a_quorum_starts_once_the_servers_are_back(
    running_cluster: EmbeddedNatsCluster, job: str
) -> None:
    nc = await bus.connect(running_cluster.url, "test")
    try:
        await register_job(nc, job)
        client = TrainMoverClient(nc)
        drained = await client.drain(job, "m1", reason="before the outage")
        connected = nc.connected_url.port  # type: ignore[union-attr]
        down = [i for i, n in enumerate(running_cluster.nodes) if n.port != connected]
        for index in down:
            running_cluster.stop_node(index, kill=True)

        async def first_event() -> str:
            async with client.watch(job, from_start=True) as items:
                async for item in items:
                    return item.event_id
            raise AssertionError("watch ended")

        opening = asyncio.create_task(first_event())
        # Longer than one JetStream API request may take: without a quorum nothing answers.
        await asyncio.sleep(6)
        assert not opening.done()
        for index in down:
            running_cluster.start_node(index)
        await asyncio.to_thread(running_cluster.wait_ready)
        assert await asyncio.wait_for(opening, 30) == drained
        for index in down:  # the next test of the module places streams on all three
            await asyncio.to_thread(running_cluster.wait_current, index)
    finally:
        await nc.close()
