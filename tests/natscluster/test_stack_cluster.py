"""`trainmover up --nats-cluster 3`: three embedded servers as one JetStream cluster,
enforcing the `--auth` users on every node, and the services' streams replicated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from trainmover import bus
from trainmover.runtime.config import JobConfig, save_config
from trainmover.security.credentials import NatsAuth, from_file
from trainmover.security.policy import Component
from trainmover.stack import Stack
from trainmover.subjects import JobSubjects


async def test_up_with_a_three_server_cluster_and_auth(tmp_path: Path) -> None:
    config = save_config(JobConfig(job="clusterjob"), tmp_path / "job.json")
    async with Stack(
        store_dir=str(tmp_path / "store"),
        job_config=str(config),
        services=["planner"],
        cluster=False,
        auth=True,
        bcrypt_cost=4,
        nats_cluster=3,
    ) as stack:
        nodes = stack.bus_cluster().nodes
        assert stack.url == ",".join(n.url for n in nodes) and len(nodes) == 3
        admin = from_file(stack.creds_file(Component("admin")))
        for node in nodes:  # every node enforces the users
            with pytest.raises(bus.BusAuthFailed):
                await bus.connect(node.url, "anonymous", auth=NatsAuth())
        nc = await bus.connect(stack.url, "test", auth=admin)
        try:
            js = nc.jetstream()
            events = JobSubjects("clusterjob").stream("EVENTS")

            async def planner_created() -> int:
                while True:
                    try:
                        return (await js.stream_info(events)).config.num_replicas or 1
                    except (NotFoundError, *bus.BUS_FAILOVER_ERRORS):
                        # Polling the bus while the planner creates the stream (and its
                        # replicas elect a leader, when a request may go unanswered).
                        await asyncio.sleep(0.1)

            assert await asyncio.wait_for(planner_created(), 120) == 3
        finally:
            await nc.close()


def test_a_cluster_with_a_given_url_is_refused() -> None:
    with pytest.raises(ValueError, match="--nats-cluster"):
        Stack(nats_url="nats://127.0.0.1:4222", nats_cluster=3)
