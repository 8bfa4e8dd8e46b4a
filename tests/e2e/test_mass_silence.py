"""A host too loaded to heartbeat fails no machine: every sidecar of the job is frozen
(SIGSTOP) past the heartbeat timeout, so every machine's heartbeats stop at once, as on
a host whose load starves them all. The health-monitor holds the silences (a host or
bus problem, not N failures), nothing moves, and once the sidecars run again the job
trains on with every machine in its role."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import urllib.request

import pytest

from tests.e2e.conftest import TP1_LONG, WAIT_S, failures_of
from trainmover.localcluster import LocalCluster

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]


def held_count(port: int, job: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(
        rf'^trainmover_health_silences_held_total\{{job="{job}"\}} (\S+)$', text, re.M
    )
    return float(found[1]) if found else 0.0


@pytest.mark.parametrize("config", [TP1_LONG])
async def test_every_sidecar_silent_at_once_fails_no_machine(cluster: LocalCluster) -> None:
    job = cluster.job
    await cluster.wait_step("m0", 10, WAIT_S)
    before = await cluster.wait_standbys_warm(WAIT_S)
    roles = {m: s.cell for m, s in before.machines.items() if s.status == "active"}
    port = cluster.stack.http_ports["health-monitor"]
    sidecars = [proc.pid for proc in cluster.stack.machines.values()]
    async with failures_of(cluster) as failures:
        for pid in sidecars:
            os.kill(pid, signal.SIGSTOP)
        try:
            # Every watched machine lapses and is held (the local cluster's heartbeat
            # timeout is 10 s).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while await asyncio.to_thread(held_count, port, job) < len(sidecars):
                assert loop.time() < deadline, "the silences were not held"
                await asyncio.sleep(0.2)
        finally:
            for pid in sidecars:
                os.kill(pid, signal.SIGCONT)
        step = cluster.steps["m0"]
        await cluster.wait_step("m0", step + 20, WAIT_S)
        assert failures == []
    after = await cluster.client.status(job)
    assert {m: s.cell for m, s in after.machines.items() if s.status == "active"} == roles
