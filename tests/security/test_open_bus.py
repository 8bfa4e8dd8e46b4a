"""On an open bus an invented instance does not re-admit a machine the planner let go.

m0 is drained (maintenance) and frozen whole (SIGSTOP: sidecar and workers). Anyone on
an open bus may publish m0's heartbeat; one naming a fresh instance, warm for every
role type, used to put m0 back in the pool, and a drain was then planned onto a frozen
machine. Now the planner asks m0 on its command subject which instance runs there; a
frozen sidecar cannot answer, so the heartbeat is dead-lettered and m0 stays out.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.conftest import TP1_LONG, WAIT_S
from tests.health_monitor.conftest import dead_letters_of
from trainmover.localcluster import LocalCluster
from trainmover.messages import Heartbeat, WorkerStatus, new_id
from trainmover.runtime.config import JobConfig
from trainmover.subjects import JobSubjects

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]


@pytest.fixture
async def cluster(tmp_path, config: JobConfig):
    async with LocalCluster(config, tmp_path) as running:  # an open bus
        yield running


@pytest.mark.parametrize("config", [TP1_LONG])
async def test_an_invented_instance_does_not_bring_a_frozen_machine_back(
    cluster: LocalCluster,
) -> None:
    job = cluster.job
    await cluster.wait_step("m0", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    drained = await cluster.client.wait_for_migration(
        job, await cluster.client.drain(job, "m0"), WAIT_S
    )
    assert drained.state == "done", drained.detail
    state = await cluster.wait_state(lambda s: s.machines["m0"].status == "maintenance", WAIT_S)
    released = state.machines["m0"].instance
    sidecar = cluster.stack.machines["m0"].pid
    os.killpg(sidecar, signal.SIGSTOP)
    try:
        dead = await dead_letters_of(cluster.nc, job)
        forged = Heartbeat(
            job=job, machine="m0", seq=10**6, status="standby",
            workers=[WorkerStatus(local_rank=0, pid=1, state="standby")],
            warm_role_types=list(cluster.config.layout.role_types()), instance=new_id(),
        )  # fmt: skip
        for _ in range(3):
            await cluster.nc.publish(JobSubjects(job).heartbeat("m0"), forged.to_json())
        letter = await dead.wait_for(
            lambda d: d.service == "planner" and "open bus" in d.reason, timeout=60
        )
        assert f"new instance {forged.instance[:8]}" in letter.reason
        assert "nobody answered" in letter.reason
        after = await cluster.client.status(job)
        assert after.machines["m0"].status == "maintenance"
        assert after.machines["m0"].instance == released
    finally:
        os.killpg(sidecar, signal.SIGCONT)
