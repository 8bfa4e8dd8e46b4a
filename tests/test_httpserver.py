"""The HTTP endpoints' limits, over real sockets on loopback: body cap (413), caps on
requests in progress (503) with the probes' own, late request heads cut (408), slow
bodies (408), and /healthz answering while slow clients trickle bytes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from trainmover.httpserver import HttpServer, Limits, json_response, read_body

WAIT = 20.0


async def request(port: int, raw: bytes) -> tuple[int, bytes]:
    """Sends `raw` at once; returns the status and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), WAIT)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def post(path: str, body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\n\r\n".encode() + body


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., asyncio.Future[HttpServer]]]:
    servers: list[HttpServer] = []
    release = asyncio.Event()
    entered: asyncio.Queue[str] = asyncio.Queue()

    async def healthz(_r: web.Request) -> web.Response:
        return json_response(200, {"status": "ok"})

    async def echo(r: web.Request) -> web.Response:
        return web.Response(body=await read_body(r))

    async def hold(r: web.Request) -> web.Response:
        entered.put_nowait(r.path)
        await release.wait()
        return web.Response(text="released")

    routes = {("GET", "/healthz"): healthz, ("POST", "/echo"): echo, ("GET", "/hold"): hold}

    async def start(limits: Limits) -> HttpServer:
        server = HttpServer(routes, limits)
        await server.start("127.0.0.1", 0)
        server.release = release  # type: ignore[attr-defined]
        server.entered = entered  # type: ignore[attr-defined]
        servers.append(server)
        return server

    yield start  # type: ignore[misc]
    release.set()
    for server in servers:
        await server.stop()


async def test_routes_body_cap_and_unknown_paths(serve) -> None:
    server = await serve(Limits(max_body_bytes=100))
    assert await request(server.port, post("/echo", b"hello")) == (200, b"hello")
    status, body = await request(server.port, post("/echo", b"", length=101))
    assert status == 413 and b"exceeds the limit of 100" in body
    assert (await request(server.port, get("/nowhere")))[0] == 404
    assert (await request(server.port, get("/echo")))[0] == 405


async def test_a_late_head_and_a_slow_body_get_408(serve) -> None:
    server = await serve(Limits(head_timeout_s=0.5, read_timeout_s=0.5))
    started = time.monotonic()
    status, _ = await request(server.port, b"GET /healthz HTTP/1.1\r\n")  # head never ends
    assert status == 408
    status, body = await request(server.port, post("/echo", b"12345", length=10))
    assert status == 408 and b"reading the body" in body
    assert time.monotonic() - started < WAIT


async def test_requests_in_progress_are_capped_but_probes_have_their_own_cap(serve) -> None:
    server = await serve(Limits(max_connections=3, max_probe_requests=2))
    held = [asyncio.create_task(request(server.port, get("/hold"))) for _ in range(3)]
    for _ in held:
        await asyncio.wait_for(server.entered.get(), WAIT)
    status, body = await request(server.port, get("/hold"))
    assert status == 503 and b"too many requests" in body
    # Three requests hold the bulk cap: the probe still answers.
    assert (await request(server.port, get("/healthz")))[0] == 200
    server.release.set()
    assert [(await h)[0] for h in held] == [200, 200, 200]


async def test_healthz_keeps_answering_while_slow_clients_trickle_bytes(serve) -> None:
    """Three times more slow clients than may wait for their head, each sending a byte a
    second and reconnecting when cut: each is cut at the head timeout or to make room,
    and /healthz answers every time meanwhile."""
    server = await serve(Limits(max_connections=4, max_probe_requests=2, head_timeout_s=1.0))
    cut: list[float] = []
    stop = asyncio.Event()

    async def trickle() -> None:
        while not stop.is_set():
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            opened = time.monotonic()
            try:
                for byte in b"POST /echo HTTP/1.1\r\nHost: x\r\n":
                    writer.write(bytes([byte]))
                    try:
                        await asyncio.wait_for(reader.read(100), 1.0)  # an answer, or the cut
                    except TimeoutError:
                        continue
                    break
            except ConnectionError:
                pass
            finally:
                cut.append(time.monotonic() - opened)
                writer.close()

    slow = [asyncio.create_task(trickle()) for _ in range(12)]
    answers = []
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        answers.append((await request(server.port, get("/healthz")))[0])
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*slow), WAIT)
    assert len(answers) > 10 and set(answers) == {200}
    # Every slow connection was cut long before it could send its 31-byte head.
    assert len(cut) > 12 and max(cut) < 5.0
