"""A private network of namespaces: one bridge in the host namespace, one namespace per
machine joined to it by a veth pair, private addresses; torn down after each test.

Needs root and iproute2 (`ip netns`, veth, bridge). Every name carries the test
process id, so concurrent runs never share an interface or a namespace.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Lan:
    """The bridge (host address `.1`) and the namespaces on it, by machine name."""

    tag: str
    subnet: str
    bridge: str
    namespaces: dict[str, str] = field(default_factory=dict)
    host_veths: dict[str, str] = field(default_factory=dict)
    inner_veths: dict[str, str] = field(default_factory=dict)

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.1"

    def add(self, machine: str) -> None:
        index = len(self.namespaces) + 2
        ns, host, inner = (
            f"tm{self.tag}-{machine}",
            f"tmh{self.tag}{index}",
            f"tmi{self.tag}{index}",
        )
        ip("netns", "add", ns)
        self.namespaces[machine] = ns
        ip("link", "add", host, "type", "veth", "peer", "name", inner)
        self.host_veths[machine] = host
        ip("link", "set", inner, "netns", ns)
        self.inner_veths[machine] = inner
        ip("link", "set", host, "master", self.bridge)
        ip("link", "set", host, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "addr", "add", f"{self.subnet}.{index}/24", "dev", inner)
        ip("-n", ns, "link", "set", inner, "up")

    def cut(self, machine: str) -> None:
        """A partition: the machine's cable is pulled; its processes keep running."""
        ip("link", "set", self.host_veths[machine], "down")

    def restore(self, machine: str) -> None:
        ip("link", "set", self.host_veths[machine], "up")

    def remove(self) -> None:
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for host in self.host_veths.values():  # normally gone with their namespace
            subprocess.run(["ip", "link", "del", host], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def lan() -> Iterator[Lan]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    pid = os.getpid()
    tag = f"{pid % 100000}"
    net = Lan(tag=tag, subnet=f"10.231.{pid % 250 + 1}", bridge=f"tmb{tag}")
    try:
        ip("link", "add", net.bridge, "type", "bridge")
        ip("addr", "add", f"{net.host_address}/24", "dev", net.bridge)
        ip("link", "set", net.bridge, "up")
        yield net
    finally:
        net.remove()


class Peer:
    """tests/netns/peer.py running inside `machine`'s namespace."""

    def __init__(self, lan: Lan, machine: str, store: str, failure_s: float, group_s: float):
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": lan.inner_veths[machine],
            "PYTHONPATH": str(ROOT),
        }
        self.name = machine
        self.proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                lan.namespaces[machine],
                sys.executable,
                "-m",
                "tests.netns.peer",
                "--name",
                machine,
                "--store",
                store,
                "--failure-timeout",
                str(failure_s),
                "--group-timeout",
                str(group_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.reply(120)["ok"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def send(self, op: str, **args: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float) -> dict:
        try:
            return json.loads(self._lines.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"{self.name}: no answer within {timeout_s}s") from None

    def call(self, op: str, timeout_s: float, **args: object) -> dict:
        self.send(op, **args)
        return self.reply(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
