"""The monitor as a real separate process (`python -m`): a 5,000-alert burst, bounded
memory, one event per machine, its threads' stacks on SIGUSR1, and a clean SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from nats.aio.client import Client as NatsClient

from tests.conftest import register_job, sample_state
from trainmover.metrics import parse_text

from .conftest import WAIT, dead_letters_of, events_of, http
from .payloads import RULES_FILE, alert, payload

MACHINES = 20
UNKNOWN = 200
ALERTS = 5_000
PER_REQUEST = 100


def rss_kib(pid: int, field: str = "VmHWM") -> int:
    """The process's peak (VmHWM) or current (VmRSS) resident memory in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def wait_port(proc: subprocess.Popen[bytes], port_file: Path) -> int:
    """The monitor's HTTP port once /healthz says ok (polls with a deadline; a thread)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"monitor exited with {proc.returncode}"
        if port_file.exists():
            port = int(port_file.read_text())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                    return port
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError("monitor did not become healthy")


async def test_burst_of_5000_alerts_in_a_separate_process(
    nc: NatsClient, job: str, nats_url: str, tmp_path: Path
) -> None:
    await register_job(nc, job, sample_state(job, machines=MACHINES, standbys=0))
    events = await events_of(nc, job)
    letters = await dead_letters_of(nc, job)
    port_file = tmp_path / "port"
    env = {**os.environ, "TRAINMOVER_WEBHOOK_TOKEN": "t0k", "TRAINMOVER_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(  # noqa: ASYNC220 - a plain child, waited for in a thread
        [
            sys.executable,
            "-m",
            "trainmover.services.health_monitor",
            "--nats-url",
            nats_url,
            "--job",
            job,
            "--rules",
            str(RULES_FILE),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--port-file",
            str(port_file),
            # No heartbeats in this test: keep the machines from lapsing meanwhile.
            "--startup-grace",
            "3600",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=(stderr := (tmp_path / "stderr").open("wb")),
    )
    try:
        port = await asyncio.to_thread(wait_port, proc, port_file)
        before = rss_kib(proc.pid, "VmRSS")

        # 5,000 alerts: every known machine over and over (Xid errors, node down), plus
        # 200 machines nobody knows; sent as Alertmanager would, in groups.
        alerts = []
        for i in range(ALERTS):
            if i % 25 == 24:
                alerts.append(alert("GPUXidError", node=f"ghost-{i % UNKNOWN}", gpu=str(i)))
            elif i % 2:
                alerts.append(alert("GPUXidError", node=f"m{i % MACHINES}", gpu=str(i % 8)))
            else:
                alerts.append(alert("NodeDown", node=f"m{i % MACHINES}", severity="critical"))
        bodies = [payload(alerts[i : i + PER_REQUEST]) for i in range(0, ALERTS, PER_REQUEST)]
        auth = {"Authorization": "Bearer t0k"}
        limit = asyncio.Semaphore(8)

        async def send(body: bytes) -> int:
            async with limit:
                return (await http(port, "/webhook", body, auth)).status

        statuses = await asyncio.gather(*(send(b) for b in bodies))
        assert statuses == [200] * len(bodies)

        await events.wait_count(MACHINES)
        scraped = parse_text((await http(port, "/metrics")).body.decode())
        assert (
            scraped[
                f'trainmover_health_events_total{{job="{job}",kind="failure",source="alertmanager"}}'
            ]
            == MACHINES
        )
        assert scraped["trainmover_health_open_incidents"] == MACHINES
        assert scraped["trainmover_health_pending_publishes"] == 0
        assert scraped['trainmover_health_alerts_total{outcome="event"}'] == MACHINES
        known = ALERTS - ALERTS // 25
        assert scraped['trainmover_health_alerts_total{outcome="duplicate"}'] == known - MACHINES
        # Unknown machines: one dead letter each at most, the rest only counted.
        published = scraped[
            f'trainmover_health_dead_letters_total{{category="unknown_machine",job="{job}"}}'
        ]
        suppressed = scraped[
            'trainmover_health_dead_letters_suppressed_total{category="unknown_machine"}'
        ]
        assert published <= UNKNOWN and published + suppressed == ALERTS // 25

        # Bounded memory: the burst leaves no per-alert state behind.
        assert rss_kib(proc.pid, "VmRSS") - before < 64 * 1024

        # Sentinel: a drain after the burst; every burst event came before it.
        drain = payload([alert("NodePlannedMaintenance", node="m0")])
        assert (await http(port, "/webhook", drain, auth)).status == 200
        await events.wait_count(MACHINES + 1)
        failures = [e.machine for e in events.items if e.kind == "failure"]
        assert sorted(failures) == sorted(f"m{i}" for i in range(MACHINES))
        assert len(events.items) == MACHINES + 1
        await letters.wait_count(int(published))
        assert all("unknown machine 'ghost-" in d.reason for d in letters.items)

        # Where every thread is, on demand; the service goes on.
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + WAIT
        # The main thread's stack comes last, from the service's entry point down.
        while "in run_service" not in (tmp_path / "stderr").read_text():
            assert time.monotonic() < deadline, "no stacks written on SIGUSR1"
            await asyncio.sleep(0.05)
        assert "most recent call first" in (tmp_path / "stderr").read_text()
        assert (await http(port, "/healthz")).status == 200
    finally:
        stderr.close()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, WAIT)
    assert code == 0
