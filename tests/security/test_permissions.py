"""Least privilege on a real nats-server running the generated config: each component
can do its job and nothing else, and a refusal reaches the caller as PermissionDenied."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

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
from trainmover.runtime.records import NatsRecordStore
from trainmover.security.credentials import CREDS_ENV
from trainmover.security.policy import Component, components_for, permissions
from trainmover.subjects import STATE_KEY, JobSubjects, kv_stream, obj_stream

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


# --- shadow-iteration records (the job's object store) -----------------------------------


@contextmanager
def record_store(bus_: SecureBus, user: str, job: str = JOB_A) -> Iterator[NatsRecordStore]:
    bucket = JobSubjects(job).records_bucket
    store = NatsRecordStore(bus_.url, bucket, f"test-{user}", auth=bus_.auth(user))
    try:
        yield store
    finally:
        store.close()


def test_sidecars_record_and_replay_their_jobs_records(
    secure_bus: SecureBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A live rank connects as its machine's sidecar through the environment, as workers do.
    monkeypatch.setenv(CREDS_ENV, str(secure_bus.creds(f"sidecar.{JOB_A}.m0")))
    live = NatsRecordStore(secure_bus.url, A.records_bucket, "test-live")
    try:
        live.put("stage.pp-recv.pt", b"first recording")
        # A re-recording replaces the object, purging the old chunks: needs the purge.
        live.put("stage.pp-recv.pt", b"second")
    finally:
        live.close()
    with record_store(secure_bus, f"sidecar.{JOB_A}.s0") as standby:
        assert standby.get("stage.pp-recv.pt") == b"second"
        assert standby.size_bytes() == len(b"second")


def test_another_jobs_sidecar_cannot_read_or_write_records(secure_bus: SecureBus) -> None:
    with record_store(secure_bus, f"sidecar.{JOB_A}.m1") as live:
        live.put("other.pp-recv.pt", b"job A's")
    for user in (f"sidecar.{JOB_B}.m1", f"sidecar.{JOB_B}.s0"):  # password and NKey
        with record_store(secure_bus, user) as intruder:
            with pytest.raises(bus.PermissionDenied, match=f"(?i){obj_stream(A.records_bucket)}"):
                intruder.get("other.pp-recv.pt")
            with pytest.raises(bus.PermissionDenied, match=f"(?i){obj_stream(A.records_bucket)}"):
                intruder.put("other.pp-recv.pt", b"forged")
    with record_store(secure_bus, f"sidecar.{JOB_A}.m2") as check:
        assert check.get("other.pp-recv.pt") == b"job A's"


def test_clients_cannot_write_records(secure_bus: SecureBus) -> None:
    with record_store(secure_bus, f"client.{JOB_A}") as client:
        with pytest.raises(bus.PermissionDenied):
            client.put("stage.pp-recv.pt", b"forged")


async def test_clients_cannot_publish_record_chunks(secure_bus: SecureBus, connect_as) -> None:
    nc = await connect_as(f"client.{JOB_A}")
    for subject in (f"$O.{A.records_bucket}.C.x", f"$O.{A.records_bucket}.M.eA"):
        with pytest.raises(bus.PermissionDenied, match="publish"):
            await bus.publish(nc, subject, b"forged")


async def test_a_sidecar_purges_only_its_records_stream(registered: SecureBus, connect_as) -> None:
    nc = await connect_as(f"sidecar.{JOB_A}.m0")
    for stream in (A.stream("EVENTS"), kv_stream(A.bucket), obj_stream(B.records_bucket)):
        with pytest.raises(bus.PermissionDenied, match="PURGE"):
            await bus.publish(nc, f"$JS.API.STREAM.PURGE.{stream}", b"")
    with pytest.raises(bus.PermissionDenied, match="DELETE"):
        await bus.publish(nc, f"$JS.API.STREAM.DELETE.{obj_stream(A.records_bucket)}", b"")


def test_only_an_exact_grant_lifts_a_destructive_deny() -> None:
    purge = "$JS.API.STREAM.PURGE.>"
    sidecar = permissions(Component("sidecar", (JOB_A,), "m0"))
    assert purge not in sidecar.publish_deny
    assert [s for s in sidecar.publish_allow if s.startswith("$JS.API.STREAM.PURGE.")] == [
        f"$JS.API.STREAM.PURGE.{obj_stream(A.records_bucket)}"
    ]
    for component in components_for({JOB_A: ["m0"]}):
        if component.role not in ("admin", "sidecar"):
            assert purge in permissions(component).publish_deny, component.name
