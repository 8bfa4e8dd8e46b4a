"""A machine whose network silently drops everything, and then one whose workers are
stuck outside any collective, are named and moved in seconds.

The whole stack of `trainmover up` runs with its bus and rendezvous store on a private
bridge (`trainmover.netns`); machine m1 (its sidecar and both workers) runs in a
network namespace of its own behind a veth pair, every other machine in the host
namespace. Taking m1's link down drops its packets without a reset: its TCP connections
stay open, its processes keep running, nothing fails until a timeout. Its peers' waits
name it from the progress board (its entry stops changing), the health-monitor declares
it failed, its role moves to a standby from its data-parallel replica, and the job ends
bit-identical to an uninterrupted run. When the link comes back, the cut-off machine's
workers can neither rejoin nor commit: it is fenced and returns as a fresh standby.
Then both workers of m2 spin outside any collective (a minute of extra compute after
their vote): named as computing and moved too.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import TP1_LONG, WAIT_S
from tests.netns.conftest import Lan, lan  # noqa: F401 - the fixture
from trainmover import bus
from trainmover.localcluster import LocalCluster
from trainmover.messages import Command, FailureEvent

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]


@pytest.mark.parametrize("config", [TP1_LONG])
async def test_a_machine_cut_off_and_one_stuck_are_named_and_moved(
    lan: Lan,  # noqa: F811 - the fixture
    tmp_path,
    reference,
) -> None:
    lan.add("m1")
    wrap = lan.machine_wrap({"m1"})
    async with LocalCluster(
        TP1_LONG, tmp_path, host=lan.host_address, machine_wrap=wrap
    ) as cluster:
        await cluster.wait_step("m1", 10, WAIT_S)
        await cluster.wait_standbys_warm(WAIT_S)
        before = (await cluster.client.status(cluster.job)).machines["m1"].instance
        async with cluster.client.watch(cluster.job) as items:
            lan.cut("m1")
            failure = await asyncio.wait_for(_failure_of(items, "m1"), WAIT_S)
        assert failure.source == "no_progress" and "of m1" in failure.reason, failure
        moved = await cluster.client.wait_for_migration(cluster.job, failure.event_id, WAIT_S)
        assert moved.state == "done" and moved.leaver == "m1", moved.detail

        lan.restore("m1")

        await cluster.wait_step("m2", max(cluster.steps.values()) + 3, WAIT_S)
        async with cluster.client.watch(cluster.job) as items:
            stuck = Command(job=cluster.job, machine="m2", op="slow", args={"extra_s": 60.0})
            reply = await bus.request(cluster.nc, stuck, timeout=10.0, deadline_s=WAIT_S)
            assert reply.ok, reply.error
            spinning = await asyncio.wait_for(_failure_of(items, "m2"), WAIT_S)
        assert "of m2 (computing)" in spinning.reason, spinning
        second = await cluster.client.wait_for_migration(cluster.job, spinning.event_id, WAIT_S)
        assert second.state == "done" and second.leaver == "m2", second.detail

        # The link is back: the machine that was cut off is fenced and returns as a new
        # instance (a fresh standby, which may since have taken m2's role).
        back = await cluster.wait_state(
            lambda s: s.machines["m1"].instance not in ("", before), WAIT_S
        )
        assert back.machines["m1"].cell is None or second.joiner == "m1"

        step, finished = await cluster.finish_soon(WAIT_S)
        assert "m2" not in finished and {moved.joiner, second.joiner} <= set(finished)
        assert "m1" not in finished or second.joiner == "m1"
        assert cluster.mismatches(await reference(step), step) == []


async def _failure_of(items, machine: str) -> FailureEvent:  # type: ignore[no-untyped-def]
    async for item in items:
        if isinstance(item, FailureEvent) and item.machine == machine:
            return item
    raise AssertionError("watch ended")
