"""The commit vote counted in the store's shards (`trainmover up --store-shards`), through
the whole system: a drain and a SIGKILLed machine (the relay of its shard) move roles
as without shards, and the result is bit-identical to the uninterrupted run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.e2e.conftest import LONG, WAIT_S
from trainmover.localcluster import LocalCluster
from trainmover.runtime.config import JobConfig
from trainmover.runtime.shardvote import shard_addresses
from trainmover.runtime.storeclient import Store

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]

SHARDS = 2


@pytest.fixture
async def cluster(tmp_path: Path, config: JobConfig) -> AsyncIterator[LocalCluster]:
    async with LocalCluster(config, tmp_path, store_shards=SHARDS) as running:
        yield running


def _keys(address: str) -> int:
    host, _, port = address.rpartition(":")
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    return client.num_keys()


@pytest.mark.parametrize("config", [LONG])
async def test_a_drain_and_a_shards_relay_killed_are_moved_through_the_shards(
    cluster: LocalCluster, reference
) -> None:
    shards = shard_addresses(Store(cluster.stack.rendezvous_address, 10))
    assert len(shards) == SHARDS
    await cluster.wait_step("m1", 10, WAIT_S)
    # The steps are voted in the shards (each holds more than its role's key).
    assert all(_keys(a) > 1 for a in shards)
    await cluster.wait_standbys_warm(WAIT_S)
    event_id = await cluster.client.drain(cluster.job, "m1", reason="driver update")
    done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail

    # m2's local rank 0 relays the job's decisions into the second shard (machines m2
    # and m3): its loss leaves m3 to read them from the job's store.
    cluster.stack.kill_machine("m2")
    state = await cluster.wait_state(lambda s: bool(s.in_flight), WAIT_S)
    (plan,) = state.in_flight.values()
    assert plan.migration == "unplanned" and plan.state_sources == {"m2": "m0"}
    done = await cluster.client.wait_for_migration(cluster.job, plan.event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail

    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == sorted(["m0", "m3", "s0", done.joiner])
    assert cluster.mismatches(await reference(step), step) == []
