"""The `lan` fixture (`trainmover.netns`: a bridge, a namespace per machine, torn down
after each test; skipped without root and iproute2) and `Peer`, a group member driven
inside its namespace."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainmover.netns import Lan, available, private_lan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lan() -> Iterator[Lan]:
    if not available():
        pytest.skip("network namespaces need root and iproute2")
    with private_lan() as net:
        yield net


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
