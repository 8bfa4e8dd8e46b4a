"""The commit vote counted in the store's shards (`trainmover up --store-shards`), through
the whole system: a drain and a SIGKILLed machine (the relay of its shard) move roles
as without shards; the serving replica SIGKILLed with its shards costs a pause; and the
result is bit-identical to the uninterrupted run."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.e2e.conftest import LONG, TP1, WAIT_S
from trainmover.localcluster import LocalCluster
from trainmover.runtime.config import JobConfig
from trainmover.runtime.shardvote import shard_addresses
from trainmover.runtime.storeclient import Store

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]

SHARDS = 2


@pytest.fixture
def replicas() -> int:
    """Replicas of the store (0: hosted in the stack's process)."""
    return 0


@pytest.fixture
async def cluster(tmp_path: Path, config: JobConfig, replicas: int) -> AsyncIterator[LocalCluster]:
    async with LocalCluster(
        config, tmp_path, store_replicas=replicas, store_shards=SHARDS
    ) as running:
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


@pytest.mark.parametrize("config,replicas", [(TP1, 2)])
async def test_the_serving_replica_lost_with_its_shards_costs_a_pause(
    cluster: LocalCluster, reference
) -> None:
    shards = shard_addresses(Store(cluster.stack.rendezvous_address, 10))
    # Each shard has a replica beside each of the store's, on the ports after it.
    assert [len(a.split(",")) for a in shards] == [2] * SHARDS
    await cluster.wait_step("m0", 10, WAIT_S)
    name, incarnation = cluster.stack.serving_replica()
    await cluster.stack.restart_service(name)  # SIGKILLed, started again: a standby
    t_kill = time.time()
    for machine in cluster.config.cluster.machines:
        await cluster.wait_step_after(machine, t_kill, WAIT_S)
    assert cluster.stack.serving_replica()[1] != incarnation
    state = await cluster.wait_state(lambda s: s.revision >= 0, WAIT_S)
    assert not state.in_flight and not state.handled, state
    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == sorted(cluster.config.cluster.machines)
    assert cluster.mismatches(await reference(step), step) == []
