"""Fixtures for the monitoring integration tests: the job's cluster, TrainMover's services
as real processes started the way deploy/ starts them, and the services' ports."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from nats.aio.client import Client as NatsClient

from tests.conftest import register_job, sample_state
from tests.integration.programs import Program, http_ok, poll
from trainmover import ports
from trainmover.stack import available_services

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TOKEN = "integration-test-token"
"""The webhook bearer token the health-monitor requires and Alertmanager sends."""


@dataclass
class LocalCluster:
    """The job the services act on: its cluster state, written as the planner would.

    With the `machines` fixture its machines also run (a sidecar with real workers each)
    and `migrates` is True: a drain then really moves the machine to a standby.
    """

    job: str
    nats_url: str
    machines: list[str]
    standbys: list[str]
    migrates: bool = False


@pytest.fixture
async def local_cluster(nc: NatsClient, job: str, nats_url: str) -> LocalCluster:
    state = sample_state(job, machines=4, standbys=1)
    await register_job(nc, job, state)
    machines = sorted(m for m, s in state.machines.items() if s.status == "active")
    standbys = sorted(m for m, s in state.machines.items() if s.status == "standby")
    return LocalCluster(job, nats_url, machines, standbys)


@pytest.fixture
def job_config(tmp_path: Path, local_cluster: LocalCluster) -> Path:
    """The job config the services get (`--job-config`), shaped like the ConfigMap's."""
    path = tmp_path / "job.yaml"
    config = {
        "job": local_cluster.job,
        "layout": {"tp": 2, "pp": 2, "dp": 2},
        # Long enough that the job is still training when the alerts arrive.
        "train": {"steps": 100_000},
        "cluster": {"machines": local_cluster.machines, "standbys": local_cluster.standbys},
        "health_monitor": {
            "rules": str(DEPLOY / "health-monitor-rules.yaml"),
            # Machines start slowly on a loaded host (each imports torch), and in the
            # tests without `machines` nothing heartbeats: keep them from lapsing; a busy
            # 2-core host can also delay a heartbeat by over a second.
            "startup_grace": 3600,
            "heartbeat_timeout_intervals": 10,
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Services:
    """TrainMover's services as processes, by name, with their bound HTTP ports."""

    ports: dict[str, int] = field(default_factory=dict)
    programs: dict[str, Program] = field(default_factory=dict)


def service_argv(name: str, nats_url: str, job_config: Path, port_file: Path) -> list[str]:
    """`trainmover service NAME` with the contract's flags (trainmover.ports), as the
    manifests and units run it, but on a loopback port the service picks."""
    argv = [sys.executable, "-m", "trainmover.cli", "service", name, "--nats-url", nats_url]
    argv += ["--job-config", str(job_config), "--http-host", "127.0.0.1"]
    argv += ["--http-port", "0", "--port-file", str(port_file), "--log-level", "warning"]
    assert {a for a in argv if a.startswith("--")} <= ports.SERVICE_FLAGS[name]
    return argv


@pytest.fixture
async def trainmover_services(
    local_cluster: LocalCluster, job_config: Path, tmp_path: Path
) -> AsyncIterator[Services]:
    """Every service `trainmover up` runs in this build, each its own process, healthy."""
    env = {**os.environ, ports.WEBHOOK_TOKEN_ENV: TOKEN}
    running = Services()
    try:
        for name in available_services():
            port_file = tmp_path / f"{name}.port"
            argv = service_argv(name, local_cluster.nats_url, job_config, port_file)
            program = Program(name, argv, tmp_path, env).start()
            running.programs[name] = program

            def bound(program: Program = program, port_file: Path = port_file) -> int | None:
                program.check_alive()
                if not port_file.exists() or not port_file.read_text().strip():
                    return None
                port = int(port_file.read_text())
                return port if http_ok(f"http://127.0.0.1:{port}{ports.HEALTH_PATH}") else None

            running.ports[name] = await poll(bound, f"{name} to be healthy")
        assert "health-monitor" in running.ports
        yield running
    finally:
        codes = {p.name: p.stop() for p in reversed(list(running.programs.values()))}
        bad = {name: code for name, code in codes.items() if code != 0}
        assert not bad, f"services did not stop cleanly: {bad}"


@pytest.fixture
async def machines(
    local_cluster: LocalCluster, job_config: Path, tmp_path: Path
) -> AsyncIterator[list[Program]]:
    """A sidecar with its real worker processes for every machine and standby of the job,
    started the way deploy/ starts them, around a rendezvous store hosted here."""
    from trainmover.runtime.rendezvous import RendezvousHost

    host = RendezvousHost()
    running: list[Program] = []
    try:
        for machine in [*local_cluster.machines, *local_cluster.standbys]:
            argv = service_argv(
                "sidecar", local_cluster.nats_url, job_config, tmp_path / f"sidecar-{machine}.port"
            )
            argv += ["--machine", machine, "--run-dir", str(tmp_path / "run" / machine)]
            if machine in local_cluster.standbys:
                argv.append("--standby")
            env = {**os.environ, "TRAINMOVER_RENDEZVOUS": host.address}
            running.append(Program(f"sidecar-{machine}", argv, tmp_path, env).start())
        for program in running:  # a drain comes to a running job, not a booting one

            def up(program: Program = program) -> int | None:
                program.check_alive()
                port_file = tmp_path / f"{program.name}.port"
                if not port_file.exists() or not port_file.read_text().strip():
                    return None
                port = int(port_file.read_text())
                return port if http_ok(f"http://127.0.0.1:{port}{ports.HEALTH_PATH}") else None

            await poll(up, f"{program.name} to be up", timeout=600)
        local_cluster.migrates = True
        yield running
    finally:
        # All at once: each sidecar stops its workers at their next step boundary.
        for program in running:
            if program.proc is not None and program.proc.poll() is None:
                program.proc.send_signal(signal.SIGTERM)
        codes = {p.name: p.wait(60) for p in running}
        host.close()
        bad = {name: code for name, code in codes.items() if code != 0}
        tails = "\n".join(f"--- {p.name}:\n{p.log_tail(6000)}" for p in running if p.name in bad)
        assert not bad, f"sidecars did not stop cleanly: {bad}\n{tails}"
