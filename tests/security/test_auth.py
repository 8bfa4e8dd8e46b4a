"""Authentication: wrong or missing credentials are refused with a clear error, a
component with credentials refuses an open bus, rotation, `trainmover up --auth`, and
no secret ever reaches a log line."""

from __future__ import annotations

import asyncio
import io
import os
import sys
from pathlib import Path

import pytest
import structlog
from nats.js.api import DeliverPolicy

from tests.health_monitor.conftest import Heartbeats
from tests.security.conftest import FAST_BCRYPT, JOB_A, SecureBus
from trainmover import bus, logs
from trainmover.client import TrainMoverClient, UnknownJob
from trainmover.messages import DeadLetter, decode, decode_event
from trainmover.natsserver import EmbeddedNats
from trainmover.runtime.config import JobConfig, save_config
from trainmover.security.authcli import generate
from trainmover.security.authcli import main as auth_main
from trainmover.security.credentials import CREDS_ENV, NatsAuth, from_file
from trainmover.services.health_monitor.config import load
from trainmover.services.health_monitor.service import HealthMonitor
from trainmover.stack import Stack
from trainmover.subjects import JobSubjects

WAIT = 60.0


async def test_wrong_password_is_refused_clearly(secure_bus: SecureBus) -> None:
    wrong = NatsAuth(user="planner", password="not-the-password-123")
    with pytest.raises(bus.BusAuthFailed) as refused:
        await bus.connect(secure_bus.url, "planner", auth=wrong)
    message = str(refused.value)
    assert "refused the credentials" in message and "'planner'" in message
    assert "not-the-password-123" not in message
    with pytest.raises(bus.BusAuthFailed, match="authorization violation"):
        await bus.connect(secure_bus.url, "anonymous", auth=NatsAuth())


async def test_credentials_refuse_an_open_bus(nats_url: str, secure_bus: SecureBus) -> None:
    with pytest.raises(bus.BusNotAuthenticated, match="accepts unauthenticated connections"):
        await bus.connect(nats_url, "planner", auth=secure_bus.auth("planner"))
    with pytest.raises(bus.BusNotAuthenticated, match="no NATS credentials are configured"):
        await bus.connect(nats_url, "planner", auth=NatsAuth(require_auth=True))


async def _run_service(*args: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "trainmover.cli",
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), WAIT)
    return proc.returncode or 0, out.decode()


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMOVER_NATS_")}
    return {**env, "TRAINMOVER_LOG_FORMAT": "json", **extra}


async def test_service_refuses_an_unauthenticated_bus(nats_url: str, secure_bus: SecureBus) -> None:
    creds = secure_bus.creds("health-monitor")
    code, out = await _run_service(
        "--nats-url",
        nats_url,
        "service",
        "health-monitor",
        "--job",
        JOB_A,
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
        env=_child_env(**{CREDS_ENV: str(creds)}),
    )
    assert code == 1, out
    lines = [line for line in out.splitlines() if line.startswith("health-monitor: error:")]
    assert len(lines) == 1 and "accepts unauthenticated connections" in lines[0], out
    assert from_file(creds).password not in out


async def _collect(nc, subject: str, parse) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg) -> None:
        queue.put_nowait(parse(msg.data))

    await nc.jetstream().subscribe(
        subject, cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
    )
    return queue


async def _first(queue: asyncio.Queue, pred) -> object:
    async def find() -> object:
        while True:
            item = await queue.get()
            if pred(item):
                return item

    return await asyncio.wait_for(find(), WAIT)


async def test_health_monitor_runs_on_its_own_credentials(
    registered: SecureBus, connect_as
) -> None:
    """The monitor needs only its rights: it reads the state, keeps its incidents, takes
    heartbeats, emits a failure and dead-letters junk, all on the least-privilege bus."""
    buf = io.StringIO()
    logs.configure("json", "debug", stream=buf)
    try:
        admin = await connect_as("admin")
        subjects = JobSubjects(JOB_A)
        letters = await _collect(admin, subjects.deadletter, lambda raw: decode(DeadLetter, raw))
        events = await _collect(admin, subjects.events, decode_event)
        argv = ["--nats-url", registered.url, "--job", JOB_A, "--http-host", "127.0.0.1"]
        argv += ["--http-port", "0", "--heartbeat-interval", "0.05", "--startup-grace", "0.2"]
        env = {CREDS_ENV: str(registered.creds("health-monitor"))}
        monitor = HealthMonitor(load(argv, env=env))
        await monitor.start()
        try:
            await monitor.wait_loaded(WAIT)
            sidecar = await connect_as(f"sidecar.{JOB_A}.m0")
            await bus.publish(sidecar, subjects.heartbeat("m0"), b'{"kind": "heartbeat"')
            letter = await _first(letters, lambda d: d.subject == subjects.heartbeat("m0"))
            assert "malformed JSON" in letter.reason and letter.service == "health-monitor"
            # A machine that never heartbeats while the others do lapses: the monitor
            # may publish failures (the others' beats by the operator's admin).
            others = Heartbeats(admin, JOB_A, {"m1", "m2", "m3", "s0"}).start()
            try:
                event = await _first(events, lambda e: e.source == "heartbeat")
            finally:
                await others.stop()
            assert event.kind == "failure" and event.job == JOB_A and event.machine == "m0"
        finally:
            await monitor.stop()
        # Deliberately log a secret under an innocent key: it prints masked.
        password = registered.auth("health-monitor").password
        assert password
        logs.get_logger("test").warning("oops", detail=f"connecting with {password}")
    finally:
        structlog.reset_defaults()
    text = buf.getvalue()
    assert "nats_connected" in text and "***" in text
    for name in ("health-monitor", f"sidecar.{JOB_A}.m0", "admin"):
        secret = registered.auth(name).password
        assert secret and secret not in text


async def test_rotated_password_replaces_the_old_one(tmp_path: Path) -> None:
    store, _ = generate(tmp_path / "auth", {"jobR": []}, rounds=FAST_BCRYPT)
    old = from_file(store.creds_file("planner"))
    server = EmbeddedNats(tmp_path / "js", config_file=store.root / "nats-server.conf").start()
    try:
        nc = await bus.connect(server.url, "planner", auth=old, max_reconnect_attempts=0)
        await nc.close()
        assert auth_main(["rotate", "--dir", str(store.root), "--bcrypt-cost", "4", "planner"]) == 0
        await asyncio.to_thread(server.reload)
        new = from_file(store.creds_file("planner"))
        assert new.password != old.password
        with pytest.raises(bus.BusAuthFailed):
            await bus.connect(server.url, "planner", auth=old, max_reconnect_attempts=0)
        nc = await bus.connect(server.url, "planner", auth=new, max_reconnect_attempts=0)
        await nc.close()
    finally:
        server.cleanup()


async def test_up_with_auth(tmp_path: Path) -> None:
    config = save_config(JobConfig(job="upjob"), tmp_path / "job.json")
    os.environ["TRAINMOVER_NATS_PASSWORD"] = "operator-secret-xyz"
    try:
        async with Stack(
            store_dir=str(tmp_path / "store"),
            job_config=str(config),
            services=[],
            cluster=False,
            bcrypt_cost=4,
        ) as plain:
            assert plain.operator_creds is None
        async with Stack(
            store_dir=str(tmp_path / "store2"),
            job_config=str(config),
            services=[],
            cluster=False,
            auth=True,
            bcrypt_cost=4,
        ) as stack:
            assert stack.jobs == {"upjob": ["m0", "m1", "m2", "m3", "s0"]}
            env = stack._service_env("health-monitor")
            assert env[CREDS_ENV] == str(stack.auth_dir / "creds" / "health-monitor.json")
            assert env["TRAINMOVER_NATS_REQUIRE_AUTH"] == "1"
            assert "TRAINMOVER_NATS_PASSWORD" not in env  # never the operator's secret
            assert stack.operator_creds == stack.auth_dir / "creds" / "client.upjob.json"
            assert oct(stack.operator_creds.stat().st_mode & 0o777) == "0o600"
            tm = await TrainMoverClient.connect(stack.url, auth=from_file(stack.operator_creds))
            async with tm:
                with pytest.raises(UnknownJob):
                    await tm.status("upjob")  # authenticated and allowed; no planner yet
            with pytest.raises(bus.BusAuthFailed):
                await bus.connect(stack.url, "anonymous", auth=NatsAuth())
    finally:
        del os.environ["TRAINMOVER_NATS_PASSWORD"]


async def test_cli_reports_a_denied_drain(registered: SecureBus) -> None:
    creds = str(registered.creds(f"client.{JOB_A}"))
    args = ["--nats-url", registered.url, "--nats-creds", creds, "drain"]
    code, out = await _run_service(*args, "jobB", "m0", env=_child_env())
    assert code == 1 and "permission denied for client.jobA" in out, out
    code, out = await _run_service(*args, JOB_A, "m3", env=_child_env())
    assert code == 0, out
