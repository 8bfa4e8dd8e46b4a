"""`trainmover service rendezvous` as deploy/ runs it: a real process hosting the store,
two real torch processes that build a gloo group through it and all-reduce, its
/healthz and /metrics, a clean stop, and clear errors on bad flags."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.programs import Program, http, poll
from trainmover import metric_names, ports

# Each rank: connect to the service's store as a client (never the server), build a
# gloo group of 2 under a prefix, all-reduce its rank + 1, print the sum.
RANK = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
host, port = sys.argv[1].rsplit(":", 1)
rank = int(sys.argv[2])
store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))
group = dist.ProcessGroupGloo(dist.PrefixStore("job/tp/g0/", store), rank, 2,
                              timedelta(seconds=300))
t = torch.tensor([rank + 1.0])
group.allreduce([t]).wait()
print(int(t.item()), flush=True)
# Interpreter teardown with a live gloo group can abort the process (SIGABRT) when the
# peer exits first (Runtime.close handles the same for workers). Not under test here.
import os
os._exit(0)
"""


def run_ranks(address: str) -> list[tuple[int, str, str]]:
    """Both ranks at once (each waits for the other in the store): (code, out, err)."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, address, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [r.communicate(timeout=300) for r in ranks]
    return [(r.returncode, out, err) for r, (out, err) in zip(ranks, outputs, strict=True)]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainmover.cli", "--log-format", "json", *args]


async def test_two_torch_processes_rendezvous_through_the_service(tmp_path: Path) -> None:
    port_file = tmp_path / "http.port"
    argv = _cli(
        "service", "rendezvous", "--store-port", "0", "--http-port", "0",
        "--port-file", str(port_file), "--store-shards", "2",
    )  # fmt: skip
    service = Program("rendezvous", argv, tmp_path).start()
    try:

        def healthy() -> dict | None:
            service.check_alive()
            if not port_file.exists() or not port_file.read_text().strip():
                return None
            status, body = http("GET", f"http://127.0.0.1:{int(port_file.read_text())}/healthz")
            return json.loads(body) if status == 200 else None

        health = await poll(healthy, "the rendezvous service to be healthy", timeout=120)
        address = f"127.0.0.1:{health['store_port']}"
        # Two keys: the replica's role (alone, it serves) and its shards' addresses.
        assert health["store"] == address and health["keys"] == 2
        assert health["role"] == "serving"
        assert len(set(health["shards"])) == 2 and address not in health["shards"]

        for code, out, err in await asyncio.to_thread(run_ranks, address):
            assert code == 0, err
            assert out.strip() == "3"  # 1 + 2: both ranks met in one group

        after = await poll(healthy, "health after the rendezvous")
        assert after["keys"] > 0  # the group's keys live in the service's store
        http_port = int(port_file.read_text())
        status, metrics = http("GET", f"http://127.0.0.1:{http_port}{ports.METRICS_PATH}")
        assert status == 200
        assert f"{metric_names.RENDEZVOUS_KEYS} {after['keys']}" in metrics.decode()
    finally:
        # A clean stop on SIGTERM; tearing torch down can take tens of seconds on a
        # loaded host, so the wait is generous (Program.stop kills after 10 s).
        assert service.proc is not None
        service.proc.send_signal(signal.SIGTERM)
        code = service.wait(180)
    assert code == 0, service.log_tail()


def test_bad_flags_are_one_line_errors() -> None:
    run = subprocess.run(
        _cli("service", "rendezvous", "--store-port", "70000"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip() == "rendezvous: error: --store-port 70000: not a port"
    # No bus needed: no --nats-url, no $TRAINMOVER_NATS_URL, and --help works.
    helped = subprocess.run(
        _cli("service", "rendezvous", "--help"), capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and "--store-port" in helped.stdout


def test_bad_replica_and_shard_flags_name_the_cause() -> None:
    cases = {
        ("--replicas", "a:1,b:2", "--replica-index", "2"): "--replica-index 2: --replicas names 2",
        ("--replicas", "a:1,b:x"): "not HOST:PORT",
        ("--replicas", "a:1,b:2", "--store-port", "7"): "names port 1 for replica 0",
        ("--replica-index", "1"): "--replica-index needs --replicas",
        ("--store-shards", "-1"): "--store-shards -1: not a number of shards",
        ("--store-port", "65535", "--store-shards", "2"): "the ports after 65535 run out",
    }
    for flags, message in cases.items():
        run = subprocess.run(
            _cli("service", "rendezvous", *flags), capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 2 and message in run.stderr, (flags, run.stderr)


async def test_a_standby_replica_serves_when_the_serving_one_is_killed(tmp_path: Path) -> None:
    from trainmover.freeports import free_ports

    stores = free_ports(2)
    address = ",".join(f"127.0.0.1:{p}" for p in stores)
    services = []
    for i in range(2):
        argv = _cli("service", "rendezvous", "--http-port", "0", "--port-file",
                    str(tmp_path / f"{i}.port"), "--replicas", address, "--replica-index", str(i))  # fmt: skip
        services.append(Program(f"rendezvous-{i}", argv, tmp_path).start())

    def role(i: int) -> str | None:
        services[i].check_alive()
        port_file = tmp_path / f"{i}.port"
        if not port_file.exists() or not port_file.read_text().strip():
            return None
        status, body = http("GET", f"http://127.0.0.1:{int(port_file.read_text())}/healthz")
        return json.loads(body).get("role") if status == 200 else None

    try:
        await poll(lambda: role(0) == "serving" or None, "replica 0 to serve", timeout=120)
        await poll(lambda: role(1) == "standby" or None, "replica 1 to stand by", timeout=120)
        assert services[0].proc is not None
        services[0].proc.kill()
        services[0].wait(60)
        await poll(lambda: role(1) == "serving" or None, "the standby to take over", timeout=60)
        # Stopped, it ends at once (SIGKILL after 10 s would give -9).
        assert services[1].stop() == 0, services[1].log_tail()
    finally:
        for service in services:
            service.stop()


async def test_a_standby_replica_stops_when_asked(tmp_path: Path) -> None:
    from trainmover.freeports import free_ports

    address = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    argv = _cli("service", "rendezvous", "--http-port", "0", "--port-file",
                str(tmp_path / "1.port"), "--replicas", address, "--replica-index", "1")  # fmt: skip
    standby = Program("rendezvous-1", argv, tmp_path).start()
    try:
        port_file = tmp_path / "1.port"
        await poll(lambda: port_file.exists() and port_file.read_text().strip() or None,
                   "the standby to listen")  # fmt: skip
        # It waits for a promotion that never comes (no other replica): SIGTERM ends it.
        assert standby.stop() == 0, standby.log_tail()
    finally:
        standby.stop()
