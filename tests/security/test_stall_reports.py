"""A sidecar's own credentials cannot fail a healthy peer with a stall report.

The whole local cluster runs under `--auth`; the attacker holds m1's sidecar
credentials, which may publish on `tm.<job>.stall.m1`, and reports m0 as holding back a
step the job never reached, and then the step it trains now. Both are refused (the
first dead-lettered naming why), no failure event is raised and training goes on.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import TP1_LONG, WAIT_S, failures_of
from tests.health_monitor.conftest import dead_letters_of
from trainmover import bus
from trainmover.localcluster import LocalCluster
from trainmover.messages import StallReport
from trainmover.security.credentials import from_file
from trainmover.security.policy import Component
from trainmover.subjects import JobSubjects

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]


@pytest.mark.parametrize("config", [TP1_LONG])
async def test_a_sidecar_cannot_fail_a_peer_by_reporting_a_stall(
    secure_cluster: LocalCluster,
) -> None:
    cluster, job = secure_cluster, secure_cluster.job
    await cluster.wait_step("m0", 10, WAIT_S)
    layout = cluster.config.layout
    state = await cluster.client.status(job)
    cell = state.machines["m0"].cell
    assert cell is not None and state.machines["m1"].cell is not None
    m0_ranks = [layout.global_rank(role) for role in layout.roles_of(cell)]

    creds = cluster.stack.creds_file(Component("sidecar", (job,), "m1"))
    forger = await bus.connect(cluster.stack.url, "forger", auth=from_file(creds))
    dead = await dead_letters_of(cluster.nc, job)
    async with failures_of(cluster) as failures:
        now = cluster.steps["m0"]
        for step in (1_000_000_000, now + 1):
            report = StallReport(
                job=job, machine="m1", epoch="e-forged", step=step, culprits={"m0": m0_ranks},
                reason="no progress", waited_s=30.0, median_step_s=0.1,
            )  # fmt: skip
            await forger.publish(JobSubjects(job).stall("m1"), report.to_json())
        await forger.flush()
        # Each reporter's refusals are dead-lettered once per window: the first says why.
        refused = await dead.wait_for(lambda d: "not the job's" in d.reason)
        # Training goes on past the forged steps' time, and nothing was failed.
        await cluster.wait_step("m0", now + 20, WAIT_S)
        assert failures == []
    await forger.close()
    assert refused.service == "health-monitor" and refused.subject.endswith(".stall.m1")
    after = await cluster.client.status(job)
    assert after.machines["m0"].status == "active" and after.machines["m0"].cell == cell
