"""The rendezvous store's serving replica SIGKILLed while the job trains, during a
drain's phase 1, and during a failure's recovery: a standby replica takes over, the job
keeps its groups and its step, every role ends held once, and the final parameters and
optimizer state are bit-identical to the uninterrupted run."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.conftest import TP1, WAIT_S, progress_reaches
from trainmover.localcluster import LocalCluster
from trainmover.runtime.config import JobConfig

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]


@pytest.fixture
def config() -> JobConfig:
    return TP1


@pytest.fixture
async def cluster(tmp_path: Path, config: JobConfig) -> AsyncIterator[LocalCluster]:
    async with LocalCluster(config, tmp_path, store_replicas=2) as running:
        yield running


async def _kill_serving_store(cluster: LocalCluster) -> str:
    """SIGKILLs the serving replica (the stack starts it again); its incarnation."""
    name, incarnation = cluster.stack.serving_replica()
    await cluster.stack.restart_service(name)
    return incarnation


async def _ends_with_every_role_held_once(cluster: LocalCluster, reference, gone: str) -> None:
    """Once nothing is in flight: one active machine per role, `gone` not among them,
    each finishing the job, with the uninterrupted run's final state."""
    state = await cluster.wait_state(lambda s: not s.in_flight, WAIT_S)
    active = sorted(n for n, m in state.machines.items() if m.status == "active")
    assert len(active) == len(cluster.config.cluster.machines) and gone not in active
    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == active
    assert cluster.mismatches(await reference(step), step) == []


async def test_the_store_lost_while_training_costs_a_pause(
    cluster: LocalCluster, reference
) -> None:
    await cluster.wait_step("m0", 10, WAIT_S)
    killed = await _kill_serving_store(cluster)
    t_kill = time.time()
    # Every machine trains on, past the loss, with no failure declared and no migration.
    for machine in cluster.config.cluster.machines:
        await cluster.wait_step_after(machine, t_kill, WAIT_S)
    assert cluster.stack.serving_replica()[1] != killed  # another incarnation serves
    state = await cluster.wait_state(lambda s: s.revision >= 0, WAIT_S)
    assert not state.in_flight and not state.handled, state
    assert {m.status for n, m in state.machines.items() if n.startswith("m")} == {"active"}
    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == sorted(cluster.config.cluster.machines)
    assert cluster.mismatches(await reference(step), step) == []


async def test_the_store_lost_in_a_drains_phase1_the_drain_completes(
    cluster: LocalCluster, reference
) -> None:
    await cluster.wait_step("m1", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    event_id = await cluster.client.drain(cluster.job, "m1", reason="store loss in phase 1")
    await progress_reaches(cluster, event_id, "phase1")
    await _kill_serving_store(cluster)
    # Done at once, or failed before the switch and planned again by the planner: the
    # drain's own event ends done either way.
    done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail
    await _ends_with_every_role_held_once(cluster, reference, gone="m1")


async def test_the_store_lost_during_a_failure_recovery_the_recovery_completes(
    cluster: LocalCluster, reference
) -> None:
    await cluster.wait_step("m2", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    cluster.stack.kill_machine("m2")
    state = await cluster.wait_state(lambda s: bool(s.in_flight), WAIT_S)
    (plan,) = state.in_flight.values()
    await _kill_serving_store(cluster)
    done = await cluster.client.wait_for_migration(cluster.job, plan.event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail
    await _ends_with_every_role_held_once(cluster, reference, gone="m2")
