"""Fixtures for the health-monitor: a monitor in-process, event and dead-letter
collectors on the real bus, a heartbeat publisher, and a real HTTP client."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from trainmover.messages import (
    DeadLetter,
    DrainEvent,
    FailureEvent,
    Heartbeat,
    RebalanceEvent,
    StragglerEvent,
    WorkerStatus,
    decode,
    decode_event,
)
from trainmover.metrics import parse_text
from trainmover.services.health_monitor.config import load
from trainmover.services.health_monitor.service import HealthMonitor
from trainmover.subjects import JobSubjects
from trainmover.tasks import cancel_and_wait

Event = DrainEvent | FailureEvent | StragglerEvent | RebalanceEvent

WAIT = 30.0
"""Generous deadline for anything awaited: other test runs share these 2 cores."""

# Short intervals, but a timeout of many intervals, so a live machine on a loaded CI
# box is never mistaken for a dead one.
FAST = ["--heartbeat-interval", "0.05", "--heartbeat-timeout-intervals", "20"]


class Collector:
    """Everything published on a JetStream subject since the collector started."""

    def __init__(self, parse: Callable[[bytes], object]) -> None:
        self._parse = parse
        self.items: list[object] = []
        self._changed = asyncio.Condition()

    async def on_msg(self, msg: Msg) -> None:
        async with self._changed:
            self.items.append(self._parse(msg.data))
            self._changed.notify_all()

    async def wait_for(self, pred: Callable[[object], bool], timeout: float = WAIT) -> object:
        """The first item matching `pred`, waiting for it up to `timeout` seconds."""

        async def find() -> object:
            async with self._changed:
                while True:
                    for item in self.items:
                        if pred(item):
                            return item
                    await self._changed.wait()

        return await asyncio.wait_for(find(), timeout)

    async def wait_count(self, n: int, timeout: float = WAIT) -> list[object]:
        async def enough() -> list[object]:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self.items) >= n)
                return list(self.items)

        return await asyncio.wait_for(enough(), timeout)


async def collect(nc: NatsClient, subject: str, parse: Callable[[bytes], object]) -> Collector:
    collector = Collector(parse)
    await nc.jetstream().subscribe(
        subject, cb=collector.on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    return collector


async def events_of(nc: NatsClient, job: str) -> Collector:
    return await collect(nc, JobSubjects(job).events, decode_event)


async def dead_letters_of(nc: NatsClient, job: str) -> Collector:
    return await collect(nc, JobSubjects(job).deadletter, lambda raw: decode(DeadLetter, raw))


def is_event(machine: str, kind: str = "failure", source: str | None = None) -> Callable:
    def pred(e: object) -> bool:
        return (
            getattr(e, "machine", None) == machine
            and getattr(e, "kind", None) == kind
            and (source is None or getattr(e, "source", None) == source)
        )

    return pred


@dataclass
class Heartbeats:
    """Publishes a heartbeat for every machine in `alive` each interval, like sidecars."""

    nc: NatsClient
    job: str
    alive: set[str]
    interval: float = 0.05
    seq: int = 0
    workers: dict[str, list[WorkerStatus]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    async def beat_once(self, machines: Iterable[str] | None = None) -> None:
        self.seq += 1
        for machine in sorted(machines if machines is not None else self.alive):
            hb = Heartbeat(
                job=self.job,
                machine=machine,
                seq=self.seq,
                status="active",
                workers=self.workers.get(machine, []),
            )
            await self.nc.publish(JobSubjects(self.job).heartbeat(machine), hb.to_json())
        await self.nc.flush()

    async def _run(self) -> None:
        while True:
            await self.beat_once()
            await asyncio.sleep(self.interval)

    def start(self) -> Heartbeats:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task:
            # Not a bare cancel(): the loop flushes every interval, and a cancel that
            # lands as a flush completes is lost on Python 3.11 (see trainmover.tasks).
            assert not await cancel_and_wait([self._task], owner="test heartbeats")


@pytest.fixture
async def heartbeats(nc: NatsClient, job: str) -> AsyncIterator[Callable[[set[str]], Heartbeats]]:
    started: list[Heartbeats] = []

    def make(alive: set[str]) -> Heartbeats:
        hb = Heartbeats(nc, job, set(alive)).start()
        started.append(hb)
        return hb

    yield make
    for hb in started:
        await hb.stop()


MonitorFactory = Callable[..., Awaitable[HealthMonitor]]


@pytest.fixture
async def monitor(nats_url: str, job: str) -> AsyncIterator[MonitorFactory]:
    """Starts HealthMonitors in this process: `await monitor("--rules", FILE, ...)`."""
    running: list[HealthMonitor] = []

    async def start(*args: str, env: dict[str, str] | None = None) -> HealthMonitor:
        argv = ["--nats-url", nats_url, "--job", job, "--http-host", "127.0.0.1"]
        argv += ["--http-port", "0", *FAST, *args]
        m = HealthMonitor(load(argv, env=env or {}))
        await m.start()
        running.append(m)
        await m.wait_loaded(WAIT)
        return m

    yield start
    for m in running:
        await m.stop()


@dataclass
class HttpReply:
    status: int
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


async def http(
    port: int,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    method: str | None = None,
) -> HttpReply:
    """A real HTTP request (urllib, in a thread) to the monitor on 127.0.0.1."""

    def call() -> HttpReply:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}",
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
            method=method or ("POST" if body is not None else "GET"),
        )
        try:
            with urllib.request.urlopen(req, timeout=WAIT) as resp:
                return HttpReply(resp.status, resp.read())
        except urllib.error.HTTPError as err:
            return HttpReply(err.code, err.read())

    return await asyncio.to_thread(call)


async def metrics(port: int) -> dict[str, float]:
    reply = await http(port, "/metrics")
    assert reply.status == 200
    return parse_text(reply.body.decode())
