"""Two `trainmover up` on one host: free HTTP ports by default, printed; fixed ones on
request, and a clear non-zero exit naming the port when one is taken."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from trainmover.freeports import free_port_block
from trainmover.ports import DEFAULT_HTTP_PORTS
from trainmover.stackports import ServiceStartError, wait_served

#: What `up` without a job config serves (the planner and executor serve a job).
SERVICES = ("health-monitor",)
ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def start_up(tmp_path: Path, name: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainmover.cli", "--log-format", "json", "up",
         "--store-dir", str(tmp_path / name / "js"), "--run-dir", str(tmp_path / name / "run"),
         *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip


def served_ports(proc: subprocess.Popen) -> dict[str, int]:
    """The `NAME: http://127.0.0.1:PORT/metrics` lines `up` prints once all serve."""
    ports: dict[str, int] = {}
    while len(ports) < len(SERVICES):
        line = proc.stdout.readline()
        assert line, f"up ended early: {proc.wait(timeout=30)} {proc.stderr.read()[-2000:]}"
        found = re.fullmatch(r"([a-z-]+): http://127\.0\.0\.1:(\d+)/metrics", line.strip())
        if found:
            ports[found[1]] = int(found[2])
    return ports


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


def metrics_of(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def test_two_stacks_on_one_host_serve_on_ports_of_their_own(tmp_path: Path) -> None:
    first, second = start_up(tmp_path, "a"), start_up(tmp_path, "b")
    try:
        ports_a, ports_b = served_ports(first), served_ports(second)
        assert set(ports_a) == set(ports_b) == set(SERVICES)
        assert not set(ports_a.values()) & set(ports_b.values())
        for port in [*ports_a.values(), *ports_b.values()]:
            assert "# TYPE" in metrics_of(port)
        stop(first)
        stop(second)
    finally:
        first.kill()
        second.kill()


def test_a_fixed_port_in_use_stops_up_with_an_error_naming_it(tmp_path: Path) -> None:
    base = free_port_block(len(DEFAULT_HTTP_PORTS))
    taken = base + list(DEFAULT_HTTP_PORTS).index("health-monitor")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        proc = start_up(tmp_path, "c", "--fixed-ports", str(base))
        try:
            code = proc.wait(timeout=120)
            err = proc.stderr.read()
        finally:
            proc.kill()
    assert code != 0
    assert f"health-monitor's HTTP port {taken} is in use" in err
    assert "running" not in err


def test_fixed_ports_from_a_base_are_served_there(tmp_path: Path) -> None:
    base = free_port_block(len(DEFAULT_HTTP_PORTS))
    proc = start_up(tmp_path, "d", "--fixed-ports", str(base))
    try:
        ports = served_ports(proc)
        order = list(DEFAULT_HTTP_PORTS)
        assert ports == {name: base + order.index(name) for name in SERVICES}
        assert "# TYPE" in metrics_of(ports["health-monitor"])
        stop(proc)
    finally:
        proc.kill()


async def test_a_service_that_exits_before_it_serves_is_named_with_its_port(
    tmp_path: Path,
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
        with pytest.raises(ServiceStartError) as refused:
            await wait_served("planner", proc, tmp_path / "planner.port", port)
    assert str(refused.value) == (
        f"the planner exited with code 3 before it served: its HTTP port {port} is in use "
        "by another process"
    )
