"""Migrations through the whole system: client -> planner -> executor -> sidecars.

Each test checks that the job kept training and that its final parameters and
optimizer state are bit-identical to the uninterrupted reference run.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import WAIT_S, Cluster

pytestmark = pytest.mark.timeout(900)


async def test_drain_through_the_client(cluster: Cluster, reference) -> None:
    await cluster.wait_step("m1", 10)
    event_id = await cluster.client.drain(cluster.job, "m1", reason="driver update")
    done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail
    assert (done.leaver, done.joiner) == ("m1", "s0")
    assert done.downtime_s is not None and "rebuilt 5 groups" in done.detail

    state = await cluster.client.status(cluster.job)
    assert state.machines["s0"].status == "active"
    assert state.machines["s0"].cell == cluster.stack.config.layout.cells()[1]
    # The joiner trains on: its steps go past the switch step.
    switch_step = max(cluster.steps.values())
    await cluster.wait_step("s0", switch_step + 5)

    # The drained machine comes back from maintenance, warm, as a standby.
    back = await cluster.wait_state(lambda s: s.machines["m1"].status == "standby")
    assert back.machines["m1"].warm_role_types == ["first", "last"]

    await cluster.wait_finished(["m0", "s0", "m2", "m3"])
    assert cluster.final_mismatches(reference) == []
