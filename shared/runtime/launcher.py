"""Local launcher: hosts the rendezvous store and the control channel, starts workers.

The rendezvous store lives in the supervising process, never on a training machine that
could be migrated away; `RendezvousHost` can be replaced by any reachable TCPStore
(pass its address), e.g. one a control-plane service hosts. Each worker is a real
process (`python -m <entry>`) that connects back to the `ControlServer`; the launcher
knows machines and local ranks, not roles; roles come from whoever answers hello.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from trainmover.runtime import control as c
from trainmover.runtime import worker as w
from trainmover.runtime.plan import RankRef

HelloHandler = Callable[[c.Hello], c.Welcome]
EventSink = Callable[[RankRef, c.Message], None]


class RendezvousHost:
    """A TCPStore server, hosted by this (non-training) process: on an ephemeral port by
    default, or on `port` (the rendezvous service's). `address` is what workers dial;
    `host` "0.0.0.0" listens everywhere and `advertise` names this machine then."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 120.0,
        port: int = 0,
        advertise: str | None = None,
    ):
        self._store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        self.port = self._store.port
        self.address = f"{advertise or host}:{self.port}"

    def keys(self) -> int:
        """Keys in the store: a round trip through its server (a liveness check)."""
        return self._store.num_keys()

    def close(self) -> None:
        del self._store


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
        self._conns: dict[RankRef, c.Connection] = {}
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

    def _register(self, ref: RankRef, conn: c.Connection) -> None:
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
        self.conn = c.Connection(
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


def spawn_worker(
    ref: RankRef,
    entry: str,
    control_address: str,
    config_path: Path,
    run_dir: Path,
    extra_env: dict[str, str] | None = None,
    process_group: int | None = None,
) -> subprocess.Popen[bytes]:
    """Starts one worker process; its output goes to run_dir/logs/<machine>-<rank>.log.
    `process_group`: 0 starts a new process group, a pid joins that process's group;
    a machine's workers share one, so a machine can die (or be killed) as a whole."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        # One thread per worker: the joiner must match the leaver's thread count for a
        # bit-identical continuation, and the cores are shared.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        w.ENV_CONTROL: control_address,
        w.ENV_MACHINE: ref.machine,
        w.ENV_LOCAL_RANK: str(ref.local_rank),
        w.ENV_CONFIG: str(config_path),
        w.ENV_RUN_DIR: str(run_dir),
        # torchrun's per-process variable; the role's (RANK, MASTER_ADDR, ...) are set by
        # the runtime once the process has a role (`trainmover.runtime.pgs`).
        "LOCAL_RANK": str(ref.local_rank),
        **(extra_env or {}),
    }
    log = open(log_dir / f"{ref.machine}-{ref.local_rank}.log", "ab")  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-m", entry],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            process_group=process_group,
        )
    finally:
        log.close()  # the child holds its own descriptor
