"""Least privilege on a real nats-server running the generated config: each component
can do its job and nothing else, and a refusal reaches the caller as PermissionDenied."""

from __future__ import annotations

import subprocess

import pytest

from tests.security.conftest import JOB_A, JOB_B, SecureBus
from trainmover import bus
from trainmover.client import TrainMoverClient
from trainmover.messages import (
    Command,
    DrainEvent,
    FailureEvent,
    Heartbeat,
    MigrationProgress,
    Plan,
    StragglerEvent,
    StragglerEvidence,
)
from trainmover.natsserver import server_binary
from trainmover.security.policy import Component, components_for, permissions
from trainmover.subjects import STATE_KEY, JobSubjects

A, B = JobSubjects(JOB_A), JobSubjects(JOB_B)


def a_plan(job: str) -> Plan:
    return Plan.model_validate(
        {
            "job": job,
            "plan_id": "p1",
            "event_id": "e1",
            "migration": "planned",
            "moves": [],
            "groups": [],
            "transfers": [],
        }
    )


def test_generated_config_is_valid_for_nats_server(secure_bus: SecureBus) -> None:
    result = subprocess.run(
        [str(server_binary()), "-t", "-c", str(secure_bus.store.root / "nats-server.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_only_admin_has_wildcard_rights() -> None:
    for component in components_for({JOB_A: ["m0"], JOB_B: ["m0"]}):
        p = permissions(component)
        broad = [s for s in p.publish_allow + p.subscribe_allow if s in (">", "tm.>", "_INBOX.>")]
        assert bool(broad) == (component.role == "admin"), component.name


async def test_client_drains_its_own_job_not_another(registered: SecureBus, connect_as) -> None:
    tm = TrainMoverClient(await connect_as(f"client.{JOB_A}"))
    event_id = await tm.drain(JOB_A, "m1", reason="driver update")
    assert event_id
    assert (await tm.status(JOB_A)).job == JOB_A

    # Another job's state and events: refused at once, and the client is told why.
    with pytest.raises(bus.PermissionDenied, match="permission denied"):
        await tm.status(JOB_B)
    event = DrainEvent(job=JOB_B, machine="m1")
    with pytest.raises(bus.PermissionDenied, match=f"tm.{JOB_B}.events.drain"):
        await bus.publish_durable(tm._js, B.event("drain"), event, msg_id=event.event_id)


async def test_client_may_not_forge_service_output(registered: SecureBus, connect_as) -> None:
    nc = await connect_as(f"client.{JOB_A}")
    js = nc.jetstream()
    evidence = StragglerEvidence(machine_median_s=2, job_median_s=1, factor=1.5, window=5)
    forged = [
        (A.event("straggler"), StragglerEvent(job=JOB_A, machine="m0", evidence=evidence)),
        (A.plans, a_plan(JOB_A)),
        (A.progress, MigrationProgress(job=JOB_A, event_id="e1", state="done")),
    ]
    for subject, message in forged:
        with pytest.raises(bus.PermissionDenied, match=subject):
            await bus.publish_durable(js, subject, message)
    with pytest.raises(bus.PermissionDenied):
        await bus.request(nc, Command(job=JOB_A, machine="m0", op="shutdown"), retries=1)
    # Nor write the cluster state, nor eavesdrop on other components' replies.
    with pytest.raises(bus.PermissionDenied):
        await bus.publish(nc, f"$KV.{A.bucket}.{STATE_KEY}", b"{}")
    with pytest.raises(bus.PermissionDenied):
        await bus.subscribe(nc, "_INBOX.>")
    with pytest.raises(bus.PermissionDenied):
        await bus.subscribe(nc, "_INBOX.planner.>")


async def test_client_watches_its_job(registered: SecureBus, connect_as) -> None:
    tm = TrainMoverClient(await connect_as(f"client.{JOB_A}"))
    async with tm.watch(JOB_A) as items:
        event_id = await tm.report_failure(JOB_A, "m2", reason="GPU fell off the bus")
        async for item in items:
            if isinstance(item, FailureEvent) and item.event_id == event_id:
                break
    with pytest.raises(bus.PermissionDenied):
        async with tm.watch(JOB_B):
            pass


async def test_sidecar_cannot_publish_a_plan(registered: SecureBus, connect_as) -> None:
    nc = await connect_as(f"sidecar.{JOB_A}.m0")
    with pytest.raises(bus.PermissionDenied, match=A.plans):
        await bus.publish_durable(nc.jetstream(), A.plans, a_plan(JOB_A))
    with pytest.raises(bus.PermissionDenied, match="events"):
        await bus.publish_durable(
            nc.jetstream(), A.event("failure"), FailureEvent(job=JOB_A, machine="m1")
        )


async def test_sidecar_speaks_only_for_its_machine(registered: SecureBus, connect_as) -> None:
    nc = await connect_as(f"sidecar.{JOB_A}.m0")
    beat = Heartbeat(job=JOB_A, machine="m0", seq=1, status="active").to_json()
    await bus.publish(nc, A.heartbeat("m0"), beat)
    await bus.publish(nc, A.stats("m0"), b"{}")
    for subject in (A.heartbeat("m1"), A.stats("m1"), A.collective_error("m1"), B.heartbeat("m0")):
        with pytest.raises(bus.PermissionDenied, match=subject):
            await bus.publish(nc, subject, beat)
    for subject in (A.command("m1"), A.heartbeats, A.events):
        with pytest.raises(bus.PermissionDenied, match="subscribe"):
            await bus.subscribe(nc, subject)
    # It reads its own job's cluster state (its role, the groups' members), no other's.
    await bus.job_bucket(nc.jetstream(), JOB_A)
    with pytest.raises(bus.PermissionDenied):
        await bus.job_bucket(nc.jetstream(), JOB_B)


async def test_executor_commands_reach_the_sidecar(registered: SecureBus, connect_as) -> None:
    sidecar = await connect_as(f"sidecar.{JOB_A}.m1")
    ran: list[str] = []

    async def handler(command: Command) -> dict[str, str]:
        ran.append(command.op)
        return {"machine": command.machine}

    server = bus.CommandServer(sidecar, JOB_A, "m1", handler)
    await server.start()
    executor = await connect_as("executor")
    reply = await bus.request(executor, Command(job=JOB_A, machine="m1", op="status"))
    assert reply.ok and reply.result == {"machine": "m1"} and ran == ["status"]
    # ...but the sidecar may not take another machine's commands.
    with pytest.raises(bus.PermissionDenied):
        await bus.CommandServer(sidecar, JOB_A, "m2", handler).start()
    await server.stop()


async def test_nkey_sidecar(registered: SecureBus, connect_as) -> None:
    auth = registered.auth(f"sidecar.{JOB_B}.s0")
    assert auth.nkey_seed and not auth.password
    nc = await connect_as(f"sidecar.{JOB_B}.s0")
    await bus.publish(nc, B.heartbeat("s0"), b"{}")
    with pytest.raises(bus.PermissionDenied):
        await bus.publish(nc, B.heartbeat("m0"), b"{}")


async def test_health_monitor_cannot_plan(registered: SecureBus, connect_as) -> None:
    nc = await connect_as("health-monitor")
    with pytest.raises(bus.PermissionDenied, match=A.plans):
        await bus.publish_durable(nc.jetstream(), A.plans, a_plan(JOB_A))
    with pytest.raises(bus.PermissionDenied):
        await bus.publish(nc, f"$KV.{A.bucket}.{STATE_KEY}", b"{}")


async def test_services_cannot_delete_streams(registered: SecureBus, connect_as) -> None:
    nc = await connect_as("planner")
    with pytest.raises(bus.PermissionDenied):
        await bus.publish(nc, f"$JS.API.STREAM.DELETE.{A.stream('EVENTS')}", b"")


def test_components_are_named_by_job_and_machine() -> None:
    assert Component("sidecar", (JOB_A,), "m0").name == f"sidecar.{JOB_A}.m0"
    with pytest.raises(ValueError):
        Component("sidecar", (JOB_A,))
    with pytest.raises(ValueError):
        Component("client", (JOB_A, JOB_B))
