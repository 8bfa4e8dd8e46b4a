"""A small HTTP/1.1 server on asyncio streams, for /webhook, /metrics and /healthz.

Just enough HTTP for Alertmanager and a Prometheus scrape, with the limits that keep a
flood from taking the service down: a cap on header size, body size (413), concurrent
connections (503, which Alertmanager retries) and read time. One request per connection
(`Connection: close`); bodies need a Content-Length (Alertmanager always sends one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from trainmover.logs import get_logger
from trainmover.metrics import CONTENT_TYPE, Registry

log = get_logger("http")

MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names."""
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, text: str, **headers: str) -> Response:
        return cls(status, (text.rstrip("\n") + "\n").encode(), headers=headers)

    @classmethod
    def json(cls, status: int, data: object) -> Response:
        return cls(status, json.dumps(data).encode() + b"\n", "application/json")


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """Routes (method, path) to handlers; unknown paths get 404, wrong methods 405."""

    def __init__(
        self,
        routes: dict[tuple[str, str], Handler],
        *,
        max_body_bytes: int = 16 * 1024 * 1024,
        max_connections: int = 64,
        read_timeout_s: float = 30.0,
        on_reject: Callable[[str, int], None] | None = None,
    ) -> None:
        self._routes = routes
        self._max_body = max_body_bytes
        self._max_connections = max_connections
        self._read_timeout = read_timeout_s
        self._on_reject = on_reject or (lambda _path, _status: None)
        self._active = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0 picks a free port); returns the bound port."""
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_HEADER_BYTES, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._active += 1
        try:
            if self._active > self._max_connections:
                # Shed load before reading anything: Alertmanager retries a 503.
                self._on_reject("", 503)
                await self._write(writer, Response.text(503, "overloaded: too many connections"))
                return
            response = await self._respond(reader)
            await self._write(writer, response)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; nothing to answer
        finally:
            self._active -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> Response:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._read_timeout)
        except (asyncio.LimitOverrunError, ValueError):
            return self._reject("", 431, "request headers too large")
        except TimeoutError:
            return self._reject("", 408, "request timeout")
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            return self._reject("", 400, "malformed request line")
        path = target.split("?", 1)[0]
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = b""
        if "transfer-encoding" in headers:
            return self._reject(path, 411, "chunked bodies are not supported: send Content-Length")
        if "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                return self._reject(path, 400, "invalid Content-Length")
            if length < 0:
                return self._reject(path, 400, "invalid Content-Length")
            if length > self._max_body:
                return self._reject(
                    path, 413, f"body of {length} bytes exceeds the limit of {self._max_body}"
                )
            try:
                body = await asyncio.wait_for(reader.readexactly(length), self._read_timeout)
            except TimeoutError:
                return self._reject(path, 408, "request timeout reading the body")
        handler = self._routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in self._routes):
                return self._reject(path, 405, f"method {method} not allowed on {path}")
            return self._reject(path, 404, f"no such path {path}")
        try:
            return await handler(Request(method, path, headers, body))
        except Exception as err:  # a handler bug must not kill the server
            log.exception("http_handler_failed", path=path, error=str(err))
            return Response.text(500, f"internal error: {type(err).__name__}")

    def _reject(self, path: str, status: int, reason: str) -> Response:
        self._on_reject(path, status)
        log.info("http_rejected", path=path, status=status, reason=reason)
        return Response.text(status, reason)

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, response: Response) -> None:
        phrase = HTTPStatus(response.status).phrase
        head = [
            f"HTTP/1.1 {response.status} {phrase}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in response.headers.items()),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body)
        await writer.drain()


async def serve_observability(
    registry: Registry, health: Callable[[], dict[str, object]], host: str, port: int
) -> HttpServer:
    """Starts /metrics (Prometheus text) and /healthz for a service; returns the server.

    `health()` returns the service's health document; /healthz answers 200 when its
    "status" is "ok" and 503 otherwise, so probes restart a service that never gets ready.
    """

    async def metrics(_request: Request) -> Response:
        return Response(200, registry.render().encode(), CONTENT_TYPE)

    async def healthz(_request: Request) -> Response:
        body = health()
        return Response.json(200 if body.get("status") == "ok" else 503, body)

    server = HttpServer({("GET", "/metrics"): metrics, ("GET", "/healthz"): healthz})
    await server.start(host, port)
    return server
