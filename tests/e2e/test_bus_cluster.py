"""The control plane on a real 3-server JetStream cluster, with a real training job.

Every stream and bucket has 3 replicas, so one job lives through, in a row: the server
leading the job's EVENTS stream SIGKILLed in a drain's phase 1, then the meta leader in
the next drain's phase 1 (both drains complete); two of three servers down for ~10 s
while it trains (the services report the bus degraded, no machine is declared failed,
all resume); and a rolling restart of all three servers just after a third drain was
acked (it completes). Each event is decided exactly once, the cluster state is intact,
and training ends bit-identical to the uninterrupted reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import TP1_SLOWED, WAIT_S, Reference, progress_reaches
from tests.e2e.scenarios import assert_each_once, stream_messages
from trainmover import bus
from trainmover.localcluster import FAST_SIGNALS, LocalCluster
from trainmover.messages import Command, decode_event
from trainmover.runtime.config import JobConfig
from trainmover.subjects import JobSubjects

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]

#: Seconds every active machine is slowed per step, so that the faults and their
#: recoveries all fall within the run (no change to the result; all alike, so none is a
#: straggler).
SLOW_S = 0.4

#: Every service of the stack reports the bus degraded (one sidecar stands for all).
REPORTERS = ("planner", "executor", "health-monitor", "sidecar-m3")


@pytest.fixture
async def on_bus_cluster(tmp_path: Path, config: JobConfig) -> AsyncIterator[LocalCluster]:
    # The slow-down below is the same on every active machine but not on a joiner until
    # its move is done: no straggler detection here (this test is about the bus).
    monitor = [*FAST_SIGNALS["health-monitor"], "--straggler-factor", "1000"]
    args = {**FAST_SIGNALS, "health-monitor": monitor}
    async with LocalCluster(
        config, tmp_path, service_args=args, nats_cluster=3, log_dir=tmp_path / "logs"
    ) as c:
        yield c


async def _leader(cluster: LocalCluster, which: str) -> int:
    """The node index of the EVENTS stream's leader or of the meta leader."""
    servers = cluster.stack.bus_cluster()
    if which == "meta":
        name = await asyncio.to_thread(servers.meta_leader)
    else:
        stream = JobSubjects(cluster.job).stream("EVENTS")
        info = await bus.through_failover(
            lambda: cluster.nc.jetstream().stream_info(stream), f"info of {stream}"
        )
        assert info.config.num_replicas == 3
        name = info.cluster.leader if info.cluster else None
    assert name, f"no {which} leader"
    return servers.index(name)


async def _slow(cluster: LocalCluster, machines: list[str], extra_s: float) -> None:
    for machine in machines:
        command = Command(job=cluster.job, machine=machine, op="slow", args={"extra_s": extra_s})
        reply = await bus.request(cluster.nc, command)
        assert reply.ok, reply.error


async def _drain_through(
    cluster: LocalCluster, machine: str, fault: Callable[[], Awaitable[None]]
) -> str:
    """Drains `machine`, runs `fault` once the drain is in phase 1; the drain completes.
    Its joiner then gets the slow-down too."""
    event_id = await cluster.client.drain(cluster.job, machine, reason="through a bus fault")
    await asyncio.wait_for(progress_reaches(cluster, event_id, "phase1"), WAIT_S)
    await fault()
    done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail
    assert done.joiner is not None
    await _slow(cluster, [done.joiner], SLOW_S)
    return event_id


def _count(path: Path, event: str) -> int:
    """Lines of `event` in the service log `path`."""
    return path.read_text(errors="replace").count(f'"event": "{event}"') if path.exists() else 0


async def _logged(logs: Path, event: str, before: dict[str, int]) -> None:
    """Until every reporter's log has more lines of `event` than `before`."""
    async with asyncio.timeout(WAIT_S):
        for service in REPORTERS:
            # A log file has no change event to await.
            while _count(logs / f"{service}.log", event) <= before[service]:  # noqa: ASYNC110
                await asyncio.sleep(0.2)


async def _healthy(logs: Path) -> None:
    """Until no reporter is still degraded from an earlier fault (each has logged as many
    recoveries as degradations): a reporter degraded already logs nothing new for the
    next outage."""
    async with asyncio.timeout(WAIT_S):
        for service in REPORTERS:
            path = logs / f"{service}.log"
            # A log file has no change event to await.
            while _count(path, "bus_recovered") < _count(path, "bus_degraded"):  # noqa: ASYNC110
                await asyncio.sleep(0.2)


async def test_bus_cluster_faults_lose_nothing(
    on_bus_cluster: LocalCluster, reference: Reference
) -> None:
    cluster = on_bus_cluster
    servers = cluster.stack.bus_cluster()
    logs = cluster.stack.log_dir
    assert logs is not None
    await cluster.wait_step("m1", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    await _slow(cluster, ["m0", "m1", "m2", "m3"], SLOW_S)

    async def kill(which: str) -> None:
        index = await _leader(cluster, which)
        await asyncio.to_thread(servers.stop_node, index, True)
        await asyncio.to_thread(servers.start_node, index)
        await asyncio.to_thread(servers.wait_ready)

    drained = [
        await _drain_through(cluster, "m1", lambda: kill("events")),
        await _drain_through(cluster, "m2", lambda: kill("meta")),
    ]

    # Quorum lost: two of three servers down for ~10 s while the job trains.
    state = await cluster.wait_state(lambda s: not s.in_flight, WAIT_S)
    active = sorted(m for m, ms in state.machines.items() if ms.status == "active")
    await _healthy(logs)
    down = [1, 2]
    counts = {
        e: {s: _count(logs / f"{s}.log", e) for s in REPORTERS}
        for e in ("bus_degraded", "bus_recovered")
    }
    for index in down:
        await asyncio.to_thread(servers.stop_node, index, True)
    await _logged(logs, "bus_degraded", counts["bus_degraded"])
    before = max(cluster.steps[m] for m in active)
    await asyncio.sleep(10)  # the outage itself (not a synchronisation)
    assert max(cluster.steps[m] for m in active) > before  # training went on
    for index in down:
        await asyncio.to_thread(servers.start_node, index)
    await asyncio.to_thread(servers.wait_ready)
    await _logged(logs, "bus_recovered", counts["bus_recovered"])

    # A rolling restart of every server, a drain acked just before it started.
    async def rolling_restart() -> None:
        await asyncio.to_thread(servers.rolling_restart)

    drained.append(await _drain_through(cluster, "m0", rolling_restart))

    state = await cluster.wait_state(lambda s: not s.in_flight, WAIT_S)
    assert {state.machines[m].status for m in ("m0", "m1", "m2")} <= {"maintenance", "standby"}
    assert all(state.machines[m].status == "active" for m in ("m3", "s0", "s1", "s2"))
    # No machine was declared failed for the bus: the events are the three drains.
    subjects = JobSubjects(cluster.job)
    events = [
        decode_event(raw) for raw in await stream_messages(cluster, subjects.events, "EVENTS")
    ]
    assert sorted(e.event_id for e in events) == sorted(drained), [e.kind for e in events]
    await assert_each_once(cluster, drained)

    await _slow(cluster, ["m3", "s0", "s1", "s2"], 0.0)
    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == ["m3", "s0", "s1", "s2"]
    assert cluster.mismatches(await reference(step), step) == []


@pytest.fixture
def config() -> JobConfig:
    return TP1_SLOWED
