"""The rendezvous store behind a gate: only clients holding the job's store secret get in.

c10d's TCPStore authenticates nobody: anyone who can reach its port may read and write
every key (an abort decision for a future step, a dropped switch). So under `--auth`
each job has a store secret (`trainmover.security`, handed out with its credentials), and:

- `Gate`: the store's server listens on loopback only; the advertised address is a gate
  that sends each new connection a nonce and forwards it to the server only once the
  connection answered HMAC-SHA256(secret, nonce); anything else is closed and logged;
- `Tunnel`: in a client's process, its c10d clients of a gated store connect to a local
  tunnel, which answers the gate's challenge and then forwards bytes both ways.

The secret comes from $TRAINMOVER_STORE_SECRET_FILE for every gated store a process
uses (workers and sidecars: the job's stores), or is registered for given addresses
(`register`: a process hosting several jobs' stacks, such as `trainmover up`'s own).
Both sides run on one asyncio loop on a daemon thread per process, which handles
thousands of connections. The server's own machine is trusted (the loopback port).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from trainmover.logs import get_logger

log = get_logger("runtime", component="storegate")

SECRET_ENV = "TRAINMOVER_STORE_SECRET_FILE"
MAGIC = b"TMSTORE1"
NONCE_BYTES = 16
#: Seconds a new connection has to answer the gate's challenge.
ANSWER_S = 5.0
CHUNK = 1 << 16

_SECRETS: dict[tuple[str, int], bytes] = {}
_LOCK = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_TUNNELS: dict[tuple[str, int], int] = {}


def new_secret() -> str:
    """A fresh store secret, as written to a job's secret file."""
    return secrets.token_hex(32)


def job_secret_file(folder: Path, job: str) -> Path:
    """The file of `job`'s store secret in a credentials folder, written (owner-only)
    when it is not there yet."""
    path = folder / f"store-{job}.secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(new_secret() + "\n")
    return path


def read_secret(path: str | Path) -> bytes:
    """The secret in the file at `path`; ValueError naming the file when it holds none."""
    text = Path(path).read_text().strip()
    if len(text) < 32:
        raise ValueError(f"store secret file {path}: no secret in it")
    return text.encode()


def register(host: str, port: int, secret: bytes) -> None:
    """Clients of this process reach the store at host:port through a tunnel."""
    with _LOCK:
        _SECRETS[(host, port)] = secret


def forget(host: str, port: int) -> None:
    """The store at host:port is gone: its secret and tunnel are dropped (a later store
    may take the port)."""
    with _LOCK:
        _SECRETS.pop((host, port), None)
        _TUNNELS.pop((host, port), None)


def secret_for(host: str, port: int) -> bytes | None:
    """The secret of the gated store at host:port, or None (a plain store)."""
    with _LOCK:
        found = _SECRETS.get((host, port))
    if found is not None:
        return found
    path = os.environ.get(SECRET_ENV)
    return read_secret(path) if path else None


def _answer(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, MAGIC + nonce, hashlib.sha256).digest()


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs `coro` on this process's gate loop (started on first use); its result."""
    global _loop
    with _LOCK:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="storegate", daemon=True).start()
        loop = _loop
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))


class Gate:
    """Admits connections to the store server on loopback port `backend` that answer
    the challenge of `secret`; listens on host:port (0: a free one)."""

    def __init__(self, host: str, port: int, backend: int, secret: bytes) -> None:
        self._backend, self._secret = backend, secret
        self._server: asyncio.Server = _run(self._start(host, port))
        self.port: int = self._server.sockets[0].getsockname()[1]

    async def _start(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._admit, host, port, backlog=4096, reuse_address=True)

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        nonce = os.urandom(NONCE_BYTES)
        try:
            writer.write(MAGIC + nonce)
            await writer.drain()
            answer = await asyncio.wait_for(reader.readexactly(32), ANSWER_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            answer = b""
        if not hmac.compare_digest(answer, _answer(self._secret, nonce)):
            log.warning(
                "store_client_refused",
                peer=str(peer),
                reason="did not answer the store gate's challenge with the job's store secret",
            )
            writer.close()
            return
        try:
            backend = await asyncio.open_connection("127.0.0.1", self._backend)
        except OSError:
            writer.close()
            return
        await _splice((reader, writer), backend)

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()

        _run(stop())


async def _through(
    target: tuple[str, int], secret: bytes, local: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    try:
        remote = await asyncio.open_connection(*target)
        hello = await asyncio.wait_for(remote[0].readexactly(len(MAGIC) + NONCE_BYTES), ANSWER_S)
        if not hello.startswith(MAGIC):
            raise ConnectionError(f"{target[0]}:{target[1]} is not a store gate")
        remote[1].write(_answer(secret, hello[len(MAGIC) :]))
        await remote[1].drain()
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as err:
        log.warning("store_gate_unreachable", store=f"{target[0]}:{target[1]}", error=str(err))
        local[1].close()
        return
    await _splice(local, remote)


def local_end(host: str, port: int) -> tuple[str, int]:
    """Where a c10d client of the store at host:port connects: the store itself, or,
    for a gated store, this process's tunnel to it."""
    secret = secret_for(host, port)
    if secret is None:
        return host, port
    with _LOCK:
        tunnel = _TUNNELS.get((host, port))
    if tunnel is None:

        async def start() -> int:
            server = await asyncio.start_server(
                lambda r, w: _through((host, port), secret, (r, w)), "127.0.0.1", 0, backlog=4096
            )
            return int(server.sockets[0].getsockname()[1])

        with _LOCK:
            tunnel = _TUNNELS.get((host, port))
        if tunnel is None:
            tunnel = _run(start())
            with _LOCK:
                tunnel = _TUNNELS.setdefault((host, port), tunnel)
    return "127.0.0.1", tunnel
