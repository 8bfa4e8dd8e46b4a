"""Benchmark: detection latency from a machine's heartbeats stopping to its failure event.

    python -m trainmover.services.health_monitor.bench [--reps 9] [--json FILE]

Starts an embedded nats-server, registers a job, runs the health-monitor as its own
process at default settings (heartbeat interval 0.5 s, timeout 3 intervals), and one
stand-in sidecar process per machine (heartbeater). For each repetition it SIGKILLs one
sidecar and measures wall time from the kill to the failure event arriving at a
subscriber on the bus. Prints and writes median/min/max. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from nats.js.api import DeliverPolicy

from trainmover import bus, logs
from trainmover.messages import ClusterState, MachineState, decode_event
from trainmover.metrics import parse_text
from trainmover.natsserver import EmbeddedNats
from trainmover.runtime.layout import Layout
from trainmover.subjects import STATE_KEY, JobSubjects

JOB = "bench"


def _state(reps: int) -> ClusterState:
    layout = Layout(tp=1, pp=1, dp=reps + 1)
    machines = {
        f"m{i}": MachineState(status="active", cell=cell) for i, cell in enumerate(layout.cells())
    }
    return ClusterState(job=JOB, layout=layout, machines=machines)


def _wait_all_up(port_file: Path, machines: int, timeout: float) -> None:
    """Blocks until the monitor's /metrics shows every machine up (run in a thread)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.exists():
            url = f"http://127.0.0.1:{int(port_file.read_text())}/metrics"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=5) as resp:
                    scraped = parse_text(resp.read().decode())
                if scraped.get(f'trainmover_health_machines_up{{job="{JOB}"}}') == machines:
                    return
        time.sleep(0.05)
    raise TimeoutError("the monitor did not hear every sidecar")


async def _run(url: str, reps: int, interval: float, intervals: float) -> dict[str, Any]:
    nc = await bus.connect(url, "bench")
    js = nc.jetstream()
    kv = await bus.ensure_job(js, JOB)
    await kv.put(STATE_KEY, _state(reps).to_json())
    arrived: dict[str, float] = {}
    got = asyncio.Event()

    async def on_event(msg: Any) -> None:
        event = decode_event(msg.data)
        if event.kind == "failure" and event.machine and event.machine not in arrived:
            arrived[event.machine] = time.time()
            got.set()

    await js.subscribe(
        JobSubjects(JOB).events,
        cb=on_event,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.NEW,
    )
    py = sys.executable
    env = {**os.environ, "TRAINMOVER_LOG_LEVEL": "warning"}
    sidecars = {
        f"m{i}": await asyncio.create_subprocess_exec(
            *[
                py,
                "-m",
                "trainmover.services.health_monitor.heartbeater",
                "--nats-url",
                url,
                "--job",
                JOB,
                "--machine",
                f"m{i}",
                "--interval",
                str(interval),
            ],
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        for i in range(reps + 1)
    }
    for proc in sidecars.values():  # wait until each publishes
        assert proc.stdout is not None
        await proc.stdout.readline()
    port_file = Path(tempfile.mkdtemp()) / "port"
    monitor = await asyncio.create_subprocess_exec(
        *[
            py,
            "-m",
            "trainmover.services.health_monitor",
            "--nats-url",
            url,
            "--job",
            JOB,
            "--heartbeat-interval",
            str(interval),
            "--heartbeat-timeout-intervals",
            str(intervals),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--port-file",
            str(port_file),
        ],
        env=env,
    )
    latencies = []
    try:
        # Start measuring once the monitor hears every sidecar.
        await asyncio.to_thread(_wait_all_up, port_file, reps + 1, 60.0)
        assert not arrived, f"false failure events before any kill: {sorted(arrived)}"
        for i in range(reps):
            machine = f"m{i}"
            # Kill at a random phase of the heartbeat interval, as a real crash would.
            await asyncio.sleep(interval * (0.37 * i % 1.0))
            got.clear()
            killed_at = time.time()
            sidecars[machine].send_signal(signal.SIGKILL)
            while machine not in arrived:
                await asyncio.wait_for(got.wait(), 30)
                got.clear()
            latencies.append(arrived[machine] - killed_at)
            print(f"{machine}: {latencies[-1]:.3f} s", file=sys.stderr, flush=True)
    finally:
        monitor.send_signal(signal.SIGTERM)
        await asyncio.wait_for(monitor.wait(), 10)
        for proc in sidecars.values():
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        await nc.close()
    return {
        "benchmark": "health_monitor_detection_latency",
        "what": "SIGKILL of a heartbeating sidecar process -> failure event on the bus",
        "heartbeat_interval_s": interval,
        "timeout_intervals": intervals,
        "timeout_s": interval * intervals,
        "repetitions": reps,
        "latency_s": {
            "median": statistics.median(latencies),
            "min": min(latencies),
            "max": max(latencies),
            "all": [round(x, 4) for x in latencies],
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainmover.services.health_monitor.bench")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--timeout-intervals", type=float, default=3.0)
    p.add_argument("--nats-url", help="use this server instead of an embedded one")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    logs.configure(level="warning", stream=sys.stderr)  # stdout carries the result
    if args.nats_url:
        result = asyncio.run(_run(args.nats_url, args.reps, args.interval, args.timeout_intervals))
    else:
        with EmbeddedNats() as server:
            result = asyncio.run(_run(server.url, args.reps, args.interval, args.timeout_intervals))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
