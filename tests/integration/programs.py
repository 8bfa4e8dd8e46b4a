"""Real programs as child processes for the integration tests: finding the binaries,
learning the port a program bound (`:0`), polling its HTTP API with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

WAIT = 60.0
"""Deadline for anything awaited: other test runs share these 2 cores."""

INSTALL_HINT = (
    "run the install step of .ci/run (apt-get install -y --no-install-recommends "
    "prometheus-alertmanager prometheus)"
)


def binary(name: str) -> str:
    """The path of a Debian-packaged program; fails loudly (no skip) when it is absent."""
    found = shutil.which(name) or (
        f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None
    )
    assert found, f"{name} not found: {INSTALL_HINT}"
    return found


def tcp_sockets(pid: int) -> list[tuple[str, int, int]]:
    """(state, local port, remote port) of each TCP socket `pid` holds, from /proc: its
    socket inodes found in the tables of its network namespace (state as the kernel
    writes it: "0A" listening, "01" established)."""
    inodes = set()
    with contextlib.suppress(FileNotFoundError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
    found = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[9]) in inodes:
                    local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
                    found.append((fields[3], local, remote))
    return found


def listening_ports(pid: int) -> set[int]:
    """TCP ports `pid` listens on.

    Prometheus and Alertmanager accept `--web.listen-address=127.0.0.1:0` but have no
    port file; reading the bound port back avoids picking a "free" port that another
    test run could take first.
    """
    return {local for state, local, _ in tcp_sockets(pid) if state == "0A"}


class Program:
    """A program run as a child process, stdout and stderr in `<log_dir>/<name>.log`."""

    def __init__(
        self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log = log_dir / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Program:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        return self

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-chars:]

    def check_alive(self) -> None:
        assert self.proc is not None, f"{self.name} not started"
        code = self.proc.poll()
        assert code is None, f"{self.name} exited with {code}:\n{self.log_tail()}"

    async def bound_port(self, timeout: float = WAIT) -> int:
        """The one port the program listens on, once it does."""
        assert self.proc is not None

        def one() -> int | None:
            self.check_alive()
            found = listening_ports(self.proc.pid)  # type: ignore[union-attr]
            assert len(found) <= 1, f"{self.name} listens on several ports {found}"
            return found.pop() if found else None

        return await poll(one, f"{self.name} to listen", timeout)

    def wait(self, timeout: float) -> int | None:
        """Waits for the program to exit (SIGKILL after `timeout`); returns the exit code.
        A program still running at `timeout` is first asked (SIGUSR1) to write its
        threads' stacks into its log: where it waits is what a failure needs."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 10 s; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


async def poll(check: Callable[[], T | None], what: str, timeout: float = WAIT) -> T:
    """Calls `check` (in a thread: it may do blocking I/O) until it returns a value other
    than None, or fails after `timeout` seconds saying what it waited for."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.1)  # a polling period, not a synchronisation


def http(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """(status, body) of one request; a JSON-able `body` is sent as JSON. Never raises
    for an HTTP status; a refused connection gives status 0."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def http_ok(url: str) -> bool | None:
    """True once GET `url` answers 200 (a readiness probe for poll())."""
    status, _ = http("GET", url)
    return True if status == 200 else None
