"""Local launcher: hosts the control channel and starts workers.

Each worker is a real process (`python -m <entry>`) that connects back to the
`ControlServer`; the launcher knows machines and local ranks, not roles; roles come from
whoever answers hello. It does not import torch: a sidecar that only starts and
supervises workers stays light (the rendezvous store is `trainmover.runtime.rendezvous`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from trainmover.runtime import control as c
from trainmover.runtime import controlconn
from trainmover.runtime.env import ENV_CONFIG, ENV_CONTROL, ENV_LOCAL_RANK, ENV_MACHINE, ENV_RUN_DIR
from trainmover.runtime.forkserver import ForkedWorker, ForkServer
from trainmover.runtime.forkserver import enabled as forkserver_enabled
from trainmover.runtime.plan import RankRef

REFERENCE_ENTRY = "trainmover.runtime.reference"
"""The worker entry of the runtime's own reference job (what a launcher starts unless
told another: an examples/ script, a test's)."""

HelloHandler = Callable[[c.Hello], c.Welcome]
EventSink = Callable[[RankRef, c.Message], None]


class ControlServer:
    """Accepts one control connection per worker and routes its messages.

    `on_hello` answers each worker's hello (its role and groups); every event goes to
    `on_event` with the sender; `request` sends a command to one worker."""

    def __init__(
        self,
        on_hello: HelloHandler,
        on_event: EventSink,
        host: str = "127.0.0.1",
        on_disconnect: Callable[[RankRef], None] | None = None,
    ):
        self._on_hello, self._on_event = on_hello, on_event
        #: Called when a named worker's connection closes (exit, or its machine died).
        self._on_disconnect = on_disconnect
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._conns: dict[RankRef, controlconn.Connection] = {}
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._accept_loop, name="control-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _WorkerLink(self, sock)

    def _register(self, ref: RankRef, conn: controlconn.Connection) -> None:
        with self._lock:
            self._conns[ref] = conn

    def connected(self) -> set[RankRef]:
        with self._lock:
            return {r for r, conn in self._conns.items() if not conn.closed.is_set()}

    def request(self, ref: RankRef, body: c.Message, timeout_s: float = 30.0) -> c.Message:
        with self._lock:
            conn = self._conns[ref]
        return conn.request(body, timeout_s)

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        with self._lock:
            for conn in self._conns.values():
                conn.close()


class _WorkerLink:
    """One worker's connection: hello names it, then its events are routed by name."""

    def __init__(self, server: ControlServer, sock: socket.socket):
        self.server = server
        self.ref: RankRef | None = None
        self.conn = controlconn.Connection(
            sock, on_request=self._on_request, on_event=self._on_event, on_close=self._on_close
        )
        self.conn.start(name="control-conn")

    def _on_close(self) -> None:
        if self.ref is not None and self.server._on_disconnect is not None:
            self.server._on_disconnect(self.ref)

    def _on_request(self, msg: c.Message) -> c.Message:
        if not isinstance(msg, c.Hello):
            raise ValueError(f"unexpected request {msg.TYPE}")
        self.ref = RankRef(machine=msg.machine, local_rank=msg.local_rank)
        welcome = self.server._on_hello(msg)
        self.server._register(self.ref, self.conn)
        return welcome

    def _on_event(self, msg: c.Message) -> None:
        assert self.ref is not None, "event before hello"
        self.server._on_event(self.ref, msg)


#: A worker process: forked by the fork server, or started as its own process.
WorkerProcess = subprocess.Popen[bytes] | ForkedWorker


def worker_env() -> dict[str, str]:
    """The environment every worker starts from: the launcher's, one thread each (the
    joiner must match the leaver's thread count for a bit-identical continuation, and
    the cores are shared)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def rank_env(
    ref: RankRef, control_address: str, config_path: Path, run_dir: Path
) -> dict[str, str]:
    """What tells a worker who it is and where its control channel is."""
    return {
        ENV_CONTROL: control_address,
        ENV_MACHINE: ref.machine,
        ENV_LOCAL_RANK: str(ref.local_rank),
        ENV_CONFIG: str(config_path),
        ENV_RUN_DIR: str(run_dir),
        # torchrun's per-process variable; the role's (RANK, MASTER_ADDR, ...) are set by
        # the runtime once the process has a role (`trainmover.runtime.pgs`).
        "LOCAL_RANK": str(ref.local_rank),
    }


class WorkerStarter:
    """Starts one launcher's workers (a sidecar's, a `LocalJob`'s): forked from its fork
    server (`trainmover.runtime.forkserver`), or each as its own process when that is
    switched off. Output goes to run_dir/logs/<machine>-<rank>.log. `process_group`: 0
    starts a new process group, a pid joins that process's group; a machine's workers
    share one, so a machine can die (or be killed) as a whole."""

    def __init__(self, run_dir: Path, name: str) -> None:
        log = run_dir / "logs" / f"forkserver-{name}.log"
        self._server = ForkServer(log, worker_env()) if forkserver_enabled() else None

    def spawn(
        self,
        ref: RankRef,
        entry: str,
        control_address: str,
        config_path: Path,
        run_dir: Path,
        extra_env: dict[str, str] | None = None,
        process_group: int | None = None,
    ) -> WorkerProcess:
        log_dir = run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{ref.machine}-{ref.local_rank}.log"
        env = {**rank_env(ref, control_address, config_path, run_dir), **(extra_env or {})}
        if self._server is not None:
            return self._server.spawn(entry, env, log, process_group)
        with open(log, "ab") as out:  # the child holds its own descriptor
            return subprocess.Popen(
                [sys.executable, "-m", entry],
                env={**worker_env(), **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                process_group=process_group,
            )

    def close(self) -> None:
        """Ends the fork server (the workers it forked are stopped first, by the caller)."""
        if self._server is not None:
            self._server.close()
