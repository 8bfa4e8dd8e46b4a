"""The production set-up: the whole local cluster under `--auth`.

Every process connects with its own least-privilege credentials (planner, executor,
health-monitor, one sidecar per machine); the test's client speaks as the job's client.
A straggler, a SIGKILLed machine and a drain all migrate, the operator's commands work
with the client's credentials, and training ends bit-identical to the reference run.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.conftest import TP1_LONG, WAIT_S
from trainmover import bus
from trainmover.localcluster import LocalCluster
from trainmover.messages import Command, StragglerEvent
from trainmover.runtime.config import JobConfig
from trainmover.security.policy import Component

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
async def secure_cluster(tmp_path: Path, config: JobConfig) -> AsyncIterator[LocalCluster]:
    async with LocalCluster(config, tmp_path, auth=True, bcrypt_cost=4) as running:
        yield running


async def _cli(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    """`trainmover ARGS` as an operator holding only the job's client credentials;
    returns the exit code and what it printed on stdout (logs go to stderr)."""
    creds = cluster.stack.creds_file(Component("client", (cluster.job,)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMOVER_NATS")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "trainmover.cli",
        "--nats-url",
        cluster.stack.url,
        "--nats-creds",
        str(creds),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert b"Traceback" not in err, err.decode()
    return proc.returncode or 0, out.decode()


async def _next_straggler(items: AsyncIterator[object]) -> StragglerEvent:
    async for item in items:
        if isinstance(item, StragglerEvent):
            return item
    raise AssertionError("watch ended")


@pytest.mark.parametrize("config", [TP1_LONG])
async def test_straggler_kill_and_drain_under_auth(secure_cluster: LocalCluster, reference) -> None:
    cluster = secure_cluster
    job = cluster.job
    await cluster.wait_step("m3", 10, WAIT_S)
    # The planner admits standbys from their heartbeats: it may subscribe to them.
    await cluster.wait_standbys_warm(WAIT_S)

    # A straggler, found by the health-monitor from m3's own step statistics.
    async with cluster.client.watch(job) as items:
        slow = Command(job=job, machine="m3", op="slow", args={"extra_s": 0.4})
        reply = await bus.request(cluster.nc, slow, timeout=10.0, deadline_s=WAIT_S)
        assert reply.ok, reply.error
        straggler = await asyncio.wait_for(_next_straggler(items), WAIT_S)
    assert straggler.machine == "m3"
    moved = await cluster.client.wait_for_migration(job, straggler.event_id, WAIT_S)
    assert moved.state == "done" and (moved.leaver, moved.joiner) == ("m3", "s0"), moved.detail

    # A SIGKILLed machine is recovered from its replica.
    cluster.stack.kill_machine("m2")
    state = await cluster.wait_state(lambda s: bool(s.in_flight), WAIT_S)
    (plan,) = state.in_flight.values()
    assert plan.migration == "unplanned" and plan.state_sources == {"m2": "m0"}
    done = await cluster.client.wait_for_migration(job, plan.event_id, timeout=WAIT_S)
    assert done.state == "done" and done.joiner == "s1", done.detail

    # A drain through the CLI with the client's credentials.
    code, out_drain = await _cli(
        cluster, "drain", job, "m1", "--reason", "driver update", "--wait", "300"
    )
    assert code == 0, out_drain or "(no output; see the services' logs)"
    assert "done" in out_drain and "m1 -> s2" in out_drain, out_drain

    # status and watch with the client's credentials, once migrations are on the bus.
    code, out = await _cli(cluster, "status", job, "--json")
    assert code == 0, out
    doc = json.loads(out)
    states = {m["event_id"]: m["state"] for m in doc["migrations"]}
    drained = out_drain.split()[0]  # the CLI prints the event id first
    assert [states[e] for e in (straggler.event_id, plan.event_id, drained)] == ["done"] * 3
    assert doc["state"]["machines"]["m2"]["status"] == "failed"
    code, out = await _cli(cluster, "watch", job, "--from-start", "--until-done")
    assert code == 0 and "done" in out, out

    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == ["m0", "s0", "s1", "s2"]
    assert cluster.mismatches(await reference(step), step) == []
