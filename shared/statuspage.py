"""The live status page of a job: `/` (one self-updating HTML page) and `/api/status`.

`trainmover up` serves it for its job: machines with their status, role and warmed
role types (standbys warm or cold), migrations in flight with the phase they are in,
recent ones with their downtime and phases, and the step rate. The page polls
/api/status (trainmover.jobview's snapshot) every second and redraws; it loads
nothing from elsewhere (the machines have no internet).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from nats.aio.client import Client as NatsClient

from trainmover.httpserver import HttpServer, json_response
from trainmover.jobview import JobView

PAGE = Path(__file__).with_name("statuspage.html")


class StatusPage:
    """Follows `job` on the bus and serves its page; `start()` then `stop()`."""

    def __init__(self, nc: NatsClient, job: str, total_steps: int | None = None) -> None:
        self.view = JobView(nc, job, total_steps)
        self._http: HttpServer | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serves on host:port (0 picks a free port); returns the page's URL."""
        await self.view.__aenter__()
        page = PAGE.read_bytes()

        async def index(_r: web.Request) -> web.Response:
            return web.Response(body=page, content_type="text/html", charset="utf-8")

        async def status(_r: web.Request) -> web.Response:
            return json_response(200, self.view.snapshot())

        self._http = HttpServer({("GET", "/"): index, ("GET", "/api/status"): status})
        self.port = await self._http.start(host, port)
        return f"http://{host}:{self.port}/"

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
        await self.view.__aexit__()
