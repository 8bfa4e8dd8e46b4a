"""A hung machine is named from the job's progress and moved, with no timeout to tune.

Both worker processes of m1 are frozen with SIGSTOP (alive, sockets open, the sidecar
still heartbeating): the ranks blocked on them see the step held back, the progress
board names m1's ranks, m1 is declared failed, fenced (SIGKILL ends a stopped process
too) and its role moves to a standby from its replica, long before the 120 s collective
timeout. Then m2 is frozen whole, sidecar and workers: named and moved the same way,
though nobody can fence it (the store's epoch refuses its workers). Then one worker of
m3 deadlocks in a collective that its peer, alive and past its vote, never joins: named
as blocked and moved. A job whose every machine is slowed alike is not blamed on anyone.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest

from tests.e2e.conftest import LONG, WAIT_S, failures_of
from trainmover import bus
from trainmover.localcluster import LocalCluster as Cluster
from trainmover.messages import Command, FailureEvent

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]


async def _slow_all(cluster: Cluster, extra_s: float) -> None:
    for machine in ("m0", "m1", "m2", "m3"):
        slow = Command(job=cluster.job, machine=machine, op="slow", args={"extra_s": extra_s})
        reply = await bus.request(cluster.nc, slow, timeout=10.0, deadline_s=WAIT_S)
        assert reply.ok, reply.error


@pytest.mark.parametrize("config", [LONG])
async def test_frozen_stuck_and_blocked_machines_are_named_and_moved(
    cluster: Cluster, reference
) -> None:
    await cluster.wait_step("m1", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    pids = await cluster.worker_pids("m1", WAIT_S)
    async with failures_of(cluster) as failures:
        # The control case: everyone slower alike for a while names nobody.
        await _slow_all(cluster, 0.3)
        now = max(cluster.steps.values())
        await cluster.wait_step("m0", now + 8, WAIT_S)
        await _slow_all(cluster, 0.0)
        assert failures == []

        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        state = await cluster.wait_state(lambda s: bool(s.in_flight), WAIT_S)
    (plan,) = state.in_flight.values()
    assert plan.migration == "unplanned" and [m.leaver for m in plan.moves] == ["m1"]
    (event,) = [f for f in failures if f.machine == "m1"]
    assert event.source == "no_progress", event
    assert "no progress: ranks" in event.reason and "of m1" in event.reason
    done = await cluster.client.wait_for_migration(cluster.job, plan.event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail

    # Fenced: the frozen processes are gone (killed, not left stopped in place).
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    # The whole of m2 frozen: its sidecar cannot answer the fence.
    await cluster.wait_step("m2", max(cluster.steps.values()) + 3, WAIT_S)
    async with cluster.client.watch(cluster.job) as items:
        os.killpg(cluster.stack.machines["m2"].pid, signal.SIGSTOP)
        second = await asyncio.wait_for(_failure_of(items, "m2"), WAIT_S)
    assert second.source == "no_progress" and "of m2 (silent)" in second.reason, second
    moved = await cluster.client.wait_for_migration(cluster.job, second.event_id, WAIT_S)
    assert moved.state == "done" and moved.leaver == "m2", moved.detail
    cluster.stack.kill_machine("m2")  # what an operator does with a frozen node

    # A worker of m3 blocked forever on a live peer: every rank waits, only it on
    # ranks that have left the step.
    await cluster.wait_step("m3", max(cluster.steps.values()) + 3, WAIT_S)
    async with cluster.client.watch(cluster.job) as items:
        block = Command(
            job=cluster.job, machine="m3", op="block", args={"group": "tp", "local_rank": 0}
        )
        reply = await bus.request(cluster.nc, block, timeout=10.0, deadline_s=WAIT_S)
        assert reply.ok, reply.error
        third = await asyncio.wait_for(_failure_of(items, "m3"), WAIT_S)
    assert third.source == "no_progress" and "of m3 (blocked)" in third.reason, third
    last = await cluster.client.wait_for_migration(cluster.job, third.event_id, WAIT_S)
    assert last.state == "done" and last.leaver == "m3", last.detail

    step, finished = await cluster.finish_soon(WAIT_S)
    joiners = {done.joiner, moved.joiner, last.joiner}
    # A fenced machine may come back as a fresh standby and take a later role.
    assert joiners <= set(finished) and {"m1", "m2", "m3"} & set(finished) <= joiners
    assert cluster.mismatches(await reference(step), step) == []


async def _failure_of(items: AsyncIterator[object], machine: str) -> FailureEvent:
    async for item in items:
        if isinstance(item, FailureEvent) and item.machine == machine:
            return item
    raise AssertionError("watch ended")
