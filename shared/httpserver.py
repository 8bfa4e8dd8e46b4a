"""The services' HTTP endpoints (/webhook, /metrics, /healthz, /) on aiohttp.

aiohttp speaks HTTP; this module adds the limits that keep a flood or slow clients from
taking a service down or blinding its probes:

- a request head must arrive within `head_timeout_s` of the connection (idle and
  byte-a-second clients are cut, answered 408, before any handler or token check);
- requests in progress are capped per class, over it 503 (Alertmanager retries a 503):
  /healthz and /metrics (the probes) have a cap of their own, so slow /webhook clients
  never starve them;
- at most `max_connections` connections may wait for their head: over it, the one
  that has waited longest (and over 0.2 s) is cut (503); a connection whose request line names a probe
  is counted apart (up to `max_probe_requests`), so a flood of slow clients cannot
  crowd /healthz and /metrics out;
- request bodies: over `max_body_bytes` -> 413, slower than `read_timeout_s` -> 408
  (`read_body`). One request per connection (`Connection: close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from trainmover.logs import get_logger
from trainmover.metrics import CONTENT_TYPE, Registry, render

log = get_logger("http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PROBE_PATHS = frozenset({"/healthz", "/metrics"})
_HEAD_END = b"\r\n\r\n"
_HEAD_LINE_MAX = 8192
_FIRST_LINE_GRACE_S = 0.2


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_connections: int = 64
    """Connections waiting for their request head, and requests in progress outside the
    probes (/webhook, the status page)."""
    max_probe_requests: int = 16
    """/healthz and /metrics connections (a cap of their own)."""
    head_timeout_s: float = 5.0
    read_timeout_s: float = 30.0


def text(status: int, body: str, **headers: str) -> web.Response:
    """A plain-text answer, one line."""
    return web.Response(status=status, text=body.rstrip("\n") + "\n", headers=headers)


async def read_body(request: web.Request) -> bytes:
    """The request's body, within the size cap (413) and read timeout (408)."""
    limits: Limits = request.app[_LIMITS]
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text="request timeout reading the body") from None


_LIMITS = web.AppKey("limits", Limits)


class _Connection(asyncio.Protocol):
    """One accepted connection: cut if its head is late (or to make room), and otherwise
    handed to aiohttp's protocol unchanged."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._inner: Any = None
        self._transport: asyncio.Transport | None = None
        self._seen = b""
        self._timer: asyncio.TimerHandle | None = None
        self.head_pending = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._server._admit(self)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._server.limits.head_timeout_s, self.cut, 408)
        self._inner = self._server._protocol_factory()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.head_pending:
            first_line_done = b"\r\n" in self._seen
            self._seen = (self._seen + data)[-_HEAD_LINE_MAX:]
            if not first_line_done and b"\r\n" in self._seen:
                # A probe sends its request line at once: from then on it is counted
                # apart from the connections a slow client could fill.
                parts = self._seen.split(b" ", 2)
                if len(parts) > 1 and parts[1].split(b"?")[0].decode("latin-1") in PROBE_PATHS:
                    self._server._as_probe(self)
            if _HEAD_END in self._seen:
                self._head_arrived()
        if self._inner is not None and not self._transport_closing():
            self._inner.data_received(data)

    def _transport_closing(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def _head_arrived(self) -> None:
        self.head_pending = False
        if self._timer is not None:
            self._timer.cancel()
        self._server._waiting.pop(self, None)

    def cut(self, status: int) -> None:
        """Ends a connection whose head did not arrive in time (or to make room)."""
        if not self.head_pending:
            return
        self._head_arrived()
        reason = "request timeout" if status == 408 else "cut: too many connections"
        self._server._rejected("", status, reason)
        if not self._transport_closing():
            assert self._transport is not None
            body = (reason + "\n").encode()
            head = (
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            self._transport.write(head.encode("latin-1") + body)
            self._transport.close()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        self._server._probes.discard(self)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class HttpServer:
    """Routes (method, path) to handlers; unknown paths get 404, wrong methods 405."""

    def __init__(
        self,
        routes: dict[tuple[str, str], Handler],
        limits: Limits | None = None,
        *,
        on_reject: Callable[[str, int], None] | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self._on_reject = on_reject or (lambda _path, _status: None)
        self._in_progress = 0
        self._probes: set[_Connection] = set()
        # Connections still waiting for their request head, oldest first.
        self._waiting: dict[_Connection, float] = {}
        self._app = web.Application(
            client_max_size=self.limits.max_body_bytes, middlewares=[self._limit_requests]
        )
        self._app[_LIMITS] = self.limits
        for (method, path), handler in routes.items():
            # aiohttp wants coroutine functions; a handler object gives its bound __call__.
            route: Handler = (
                handler if inspect.iscoroutinefunction(handler) else handler.__call__  # type: ignore[operator]
            )
            self._app.router.add_route(method, path, route)
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0 picks a free port); returns the bound port."""
        self._runner = web.AppRunner(
            self._app, access_log=None, handle_signals=False, lingering_time=0
        )
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in [*self._waiting, *self._probes]:
                conn.cut(503)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._runner.cleanup(), 5)
            self._runner = None

    def _protocol_factory(self) -> asyncio.Protocol:
        assert self._runner is not None and self._runner.server is not None
        return self._runner.server()

    def _admit(self, conn: _Connection) -> None:
        """A new connection waits for its head. Over the cap, the longest waiting are cut,
        but none sooner than a moment after it opened: a probe arriving amid a flood of
        new connections still gets to send its request line."""
        now = time.monotonic()
        self._waiting[conn] = now
        while len(self._waiting) > self.limits.max_connections:
            oldest, opened = next(iter(self._waiting.items()))
            if now - opened < _FIRST_LINE_GRACE_S:
                break
            oldest.cut(503)

    def _as_probe(self, conn: _Connection) -> None:
        """`conn` sent a probe's request line: counted with the probes, or cut if full."""
        self._waiting.pop(conn, None)
        if len(self._probes) >= self.limits.max_probe_requests:
            conn.cut(503)
        else:
            self._probes.add(conn)

    def _rejected(self, path: str, status: int, reason: str) -> None:
        self._on_reject(path, status)
        log.info("http_rejected", path=path, status=status, reason=reason)

    @web.middleware
    async def _limit_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await self._limited(request, handler)
        response.force_close()  # one request per connection
        return response

    async def _limited(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # Probes are capped per connection (_as_probe); the rest per request in progress.
        bulk = request.path not in PROBE_PATHS
        length = request.content_length
        if bulk and self._in_progress >= self.limits.max_connections:
            return self._refuse(request.path, 503, "overloaded: too many requests in progress")
        if length is not None and length > self.limits.max_body_bytes:
            reason = f"body of {length} bytes exceeds the limit of {self.limits.max_body_bytes}"
            return self._refuse(request.path, 413, reason)
        self._in_progress += bulk
        try:
            return await handler(request)
        except web.HTTPException as err:
            return self._refuse(request.path, err.status, err.text or err.reason)
        except Exception as err:  # a handler bug must not kill the server
            log.exception("http_handler_failed", path=request.path, error=str(err))
            return text(500, f"internal error: {type(err).__name__}")
        finally:
            self._in_progress -= bulk

    def _refuse(self, path: str, status: int, reason: str) -> web.Response:
        self._rejected(path, status, reason)
        return text(status, reason)


def json_response(status: int, data: object) -> web.Response:
    return web.json_response(data, status=status)


async def serve_observability(
    registry: Registry,
    health: Callable[[], dict[str, object]],
    host: str,
    port: int,
    extra: dict[tuple[str, str], Handler] | None = None,
) -> HttpServer:
    """Starts /metrics (Prometheus text) and /healthz for a service; returns the server.

    `health()` returns the service's health document; /healthz answers 200 when its
    "status" is "ok" and 503 otherwise, so probes restart a service that never gets ready.
    `extra` adds routes (the planner's status page).
    """

    async def metrics(_request: web.Request) -> web.Response:
        return metrics_response(registry)

    async def healthz(_request: web.Request) -> web.Response:
        body = health()
        return json_response(200 if body.get("status") == "ok" else 503, body)

    routes: dict[tuple[str, str], Handler] = {
        ("GET", "/metrics"): metrics,
        ("GET", "/healthz"): healthz,
    }
    server = HttpServer({**routes, **(extra or {})})
    await server.start(host, port)
    return server


def metrics_response(registry: Registry) -> web.Response:
    """GET /metrics: the registry in the Prometheus text format."""
    response = web.Response(body=render(registry))
    response.headers["Content-Type"] = CONTENT_TYPE
    return response
