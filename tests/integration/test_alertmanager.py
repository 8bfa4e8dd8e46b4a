"""The real Alertmanager (Debian's prometheus-alertmanager) with deploy/'s receiver
config delivers its own webhook to the real health-monitor, which puts the event on the
bus; a resolved alert puts nothing there.

Alertmanager runs on loopback with its own storage, clustering off, and the shipped
config with only the webhook's URL and token file pointed at this test's health-monitor
and the grouping delays shortened."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import DEPLOY, TOKEN, LocalCluster, Services
from tests.integration.programs import WAIT, Program, binary, http, http_ok, poll
from trainmover import ports
from trainmover.client import Event, TrainMoverClient, Watch
from trainmover.messages import DrainEvent, FailureEvent, MigrationProgress
from trainmover.metrics import parse_text

MIGRATION_WAIT = 600.0
"""The machines' workers start slowly on a loaded host (each imports torch)."""

COVERS = ["alertmanager/alertmanager.yml", "health-monitor-rules.yaml"]

CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"


def render_config(webhook_url: str, token_file: Path) -> dict[str, Any]:
    """deploy/'s Alertmanager config for this test: the receiver's URL and token file
    substituted, and short grouping delays (seconds in production, here 0 s / 200 ms) so
    notifications, including a resolved one, go out at once."""
    config = yaml.safe_load(CONFIG.read_text())
    (receiver,) = [r for r in config["receivers"] if r["name"] == "trainmover"]
    (hook,) = receiver["webhook_configs"]
    hook["url"] = webhook_url
    hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    for route in [config["route"], *config["route"]["routes"]]:
        route["group_wait"] = "0s"
        route["group_interval"] = "200ms"
    return config  # type: ignore[no-any-return]


@dataclass
class Alertmanager:
    url: str
    program: Program

    def post(self, *alerts: dict[str, Any]) -> None:
        status, body = http("POST", f"{self.url}/api/v2/alerts", list(alerts))
        assert status == 200, f"Alertmanager refused the alerts: {status} {body!r}"


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("amtool"), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
async def alertmanager(
    trainmover_services: Services, tmp_path: Path
) -> AsyncIterator[Alertmanager]:
    port = trainmover_services.ports["health-monitor"]
    token_file = tmp_path / "webhook-token"
    token_file.write_text(TOKEN)
    config = tmp_path / "alertmanager.yml"
    config.write_text(
        yaml.safe_dump(render_config(f"http://127.0.0.1:{port}{ports.WEBHOOK_PATH}", token_file))
    )
    check = await asyncio.to_thread(amtool, "check-config", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    argv = [
        binary("prometheus-alertmanager"),
        f"--config.file={config}",
        f"--storage.path={tmp_path / 'alertmanager-data'}",
        "--web.listen-address=127.0.0.1:0",
        "--cluster.listen-address=",  # empty: no gossip cluster, no second port
        "--log.level=warn",
    ]
    program = Program("alertmanager", argv, tmp_path).start()
    try:
        url = f"http://127.0.0.1:{await program.bound_port()}"
        await poll(lambda: http_ok(f"{url}/-/ready"), "Alertmanager to be ready")
        yield Alertmanager(url, program)
    finally:
        program.stop()


def test_shipped_config_passes_amtool() -> None:
    run = amtool("check-config", str(CONFIG))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def alert(
    name: str, node: str, starts: datetime, ends: datetime | None = None, **annotations: str
) -> dict[str, Any]:
    """An alert as Prometheus posts it to Alertmanager's API v2."""
    body: dict[str, Any] = {
        "labels": {"alertname": name, "node": node, "severity": "info"},
        "annotations": {"summary": f"{name} on {node}", **annotations},
        "startsAt": iso(starts),
        "generatorURL": "http://prometheus.test/graph",
    }
    if ends is not None:
        body["endsAt"] = iso(ends)
    return body


async def next_event(items: Watch) -> Event:
    """The next interruption event on the job's bus (progress of migrations skipped)."""

    async def first() -> Event:
        async for item in items:
            if not isinstance(item, MigrationProgress):
                return item
        raise AssertionError("the watch ended")

    try:
        return await asyncio.wait_for(first(), WAIT)
    except TimeoutError:
        raise AssertionError(f"no event on the bus within {WAIT:g}s") from None


def resolved_alerts(port: int) -> float | None:
    """How many resolved alerts the health-monitor's webhook received (None before one)."""
    status, body = http("GET", f"http://127.0.0.1:{port}{ports.METRICS_PATH}")
    assert status == 200
    value = parse_text(body.decode()).get('trainmover_health_alerts_total{outcome="resolved"}', 0)
    return value or None


async def test_alertmanager_webhook_drains_and_a_resolved_alert_emits_nothing(
    alertmanager: Alertmanager,
    trainmover_services: Services,
    local_cluster: LocalCluster,
    machines: list[Program],
) -> None:
    job = local_cluster.job
    leaver, marker, quiet = (
        local_cluster.machines[1],
        local_cluster.machines[2],
        local_cluster.machines[3],
    )
    started = datetime.now(UTC) - timedelta(minutes=1)
    async with await TrainMoverClient.connect(local_cluster.nats_url) as tm:
        async with tm.watch(job) as items:
            # 1. A maintenance alert for a known machine: Alertmanager routes it to the
            # trainmover receiver, whose webhook (with the bearer token) reaches the
            # health-monitor, which publishes a drain with the annotated deadline.
            alertmanager.post(
                alert("NodePlannedMaintenance", leaver, started, drain_deadline="900")
            )
            drain = await next_event(items)
            assert isinstance(drain, DrainEvent), drain
            assert (drain.job, drain.machine, drain.deadline_s) == (job, leaver, 900)
            assert drain.source == "alertmanager"
            assert "via Alertmanager receiver 'trainmover'" in drain.reason

            # The local cluster moves the machine's role to the standby.
            assert local_cluster.migrates
            done = await tm.wait_for_migration(job, drain.event_id, timeout=MIGRATION_WAIT)
            assert done.state == "done" and done.leaver == leaver, done
            assert done.joiner in local_cluster.standbys

            # 2. The alert resolves (endsAt in the past): Alertmanager sends the resolved
            # notification (send_resolved), the health-monitor receives it, and nothing is
            # published. Also an alert that is resolved from the start, for another known
            # machine (Alertmanager does not even notify it).
            now = datetime.now(UTC)
            alertmanager.post(
                alert(
                    "NodePlannedMaintenance",
                    leaver,
                    started,
                    now - timedelta(seconds=1),
                    drain_deadline="900",
                ),
                alert("GPUXidError", quiet, started, now - timedelta(seconds=1)),
            )
            port = trainmover_services.ports["health-monitor"]
            await poll(lambda: resolved_alerts(port), "the resolved notification to arrive")

            # 3. A marker: a new firing alert. Its event is the next one on the bus, so
            # nothing was published for the resolved alerts before it.
            alertmanager.post(alert("GPUXidError", marker, datetime.now(UTC)))
            after = await next_event(items)
            assert isinstance(after, FailureEvent), after
            assert (after.machine, after.source) == (marker, "alertmanager"), after.reason

    status, body = http("GET", f"http://127.0.0.1:{port}{ports.METRICS_PATH}")
    scraped = parse_text(body.decode())
    # Every webhook request carried the right token; none was refused.
    assert scraped.get('trainmover_health_webhook_requests_total{outcome="unauthorized"}', 0) == 0
    assert scraped['trainmover_health_alerts_total{outcome="event"}'] == 2
    alertmanager.program.check_alive()
