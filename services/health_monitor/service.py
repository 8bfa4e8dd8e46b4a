"""The health-monitor service: wires the bus, the detectors, the emitter and HTTP.

Per watched job it subscribes to heartbeats, step statistics and collective-error
reports, follows the job's cluster state in the KV bucket, and checks heartbeat
deadlines every tick. Every decision is logged with its job, machine and reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError

from trainmover import bus
from trainmover.bus.clusterstate import follow_states
from trainmover.bushealth import BusHealth
from trainmover.httpserver import HttpServer, Limits, json_response, metrics_response
from trainmover.logs import get_logger
from trainmover.messages import (
    ClusterState,
    MessageError,
)
from trainmover.services.health_monitor.config import Settings
from trainmover.services.health_monitor.dedup import IncidentTable, SeenWindow, TokenBucket
from trainmover.services.health_monitor.emitter import Emitter
from trainmover.services.health_monitor.heartbeats import HeartbeatTracker
from trainmover.services.health_monitor.metrics import HealthMetrics
from trainmover.services.health_monitor.plausible import (
    StepBounds,
)
from trainmover.services.health_monitor.roster import Roster, RosterChange
from trainmover.services.health_monitor.rules import load_rules
from trainmover.services.health_monitor.signals import Signals
from trainmover.services.health_monitor.stragglers import StragglerDetector
from trainmover.services.health_monitor.webhook import WebhookHandler
from trainmover.subjects import JobSubjects
from trainmover.tasks import cancel_and_wait

SERVICE = "health-monitor"
log = get_logger(SERVICE)

STOP_STEP_S = 10.0
"""The longest each part of a stop may take: a stop must end, whatever the bus does."""


def _write_port_file(path: Path, port: int) -> None:
    # Write then rename, so a reader never sees a half-written file.
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


class HealthMonitor:
    """One running health-monitor; `start()` then `stop()`, or `async with`."""

    def __init__(self, settings: Settings, nc: NatsClient | None = None) -> None:
        self.settings = settings
        self.metrics = HealthMetrics()
        self._bus_health = BusHealth("health-monitor", self.metrics.bus_degraded, settings.jobs)
        self.roster = Roster(settings.jobs, settings.watch_statuses)
        self.tracker = HeartbeatTracker(settings.heartbeat_timeout, settings.grace)
        self.stragglers = StragglerDetector(
            settings.straggler_factor, settings.straggler_steps, settings.straggler_window
        )
        self.steps = StepBounds()
        self.rules = load_rules(settings.rules)
        self._given_nc = nc
        self._nc: NatsClient | None = None
        self.emitter: Emitter | None = None
        self.signals: Signals | None = None
        self.http: HttpServer | None = None
        self._subs: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._loaded = asyncio.Event()
        # One dead letter per (job, category, machine) per dedup window, and at most
        # dead_letter_rate per second overall: a flood of junk must not flood the bus.
        self._rejected: SeenWindow[tuple[str, str, str]] = SeenWindow(settings.dedup_window)
        self._reject_bucket = TokenBucket(
            settings.dead_letter_rate, settings.dead_letter_rate * 10, time.monotonic()
        )
        self.port = 0

    # --- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        if self._given_nc is not None:
            self._nc = self._given_nc
        else:
            if not s.nats_url:
                raise bus.BusUnreachable("no NATS URL: pass --nats-url or set TRAINMOVER_NATS_URL")
            self._nc = await bus.connect(s.nats_url, SERVICE, auth=s.nats_auth)
        js = self._nc.jetstream()
        self.emitter = Emitter(js, IncidentTable(s.dedup_window), self.metrics)
        for job in s.jobs:
            await bus.ensure_job(js, job)
            await self.emitter.add_job(job)
        self.emitter.start()
        self.signals = signals = Signals(
            s,
            self.roster,
            self.tracker,
            self.stragglers,
            self.steps,
            self.metrics,
            self.emitter,
            self._reject,
        )
        for job in s.jobs:
            subjects = JobSubjects(job)
            # bus.subscribe: a subscription the bus refuses ends the start with its subject.
            nc = self._nc
            self._subs += [
                await bus.subscribe(nc, subjects.heartbeats, cb=self._guard(signals.on_heartbeat)),
                await bus.subscribe(nc, subjects.all_stats, cb=self._guard(signals.on_stats)),
                await bus.subscribe(
                    nc, subjects.collective_errors, cb=self._guard(signals.on_collective_error)
                ),
                await bus.subscribe(nc, subjects.stalls, cb=self._guard(signals.on_stall)),
            ]
            self._tasks.append(asyncio.create_task(self._follow_state(job)))
        self._tasks.append(asyncio.create_task(self._check_loop()))
        self._tasks.append(asyncio.create_task(self._bus_health.watch(self._nc)))
        webhook = WebhookHandler(
            rules=self.rules,
            roster=self.roster,
            emitter=self.emitter,
            reject=self._reject,
            metrics=self.metrics,
            token=s.webhook_token,
            publish_timeout=s.publish_timeout,
        )
        self.http = HttpServer(
            {
                ("POST", "/webhook"): webhook,
                ("GET", "/metrics"): self._metrics_route,
                ("GET", "/healthz"): self._healthz_route,
            },
            Limits(max_body_bytes=s.max_body_bytes, max_connections=s.max_connections),
            on_reject=self._on_http_reject,
        )
        self.port = await self.http.start(s.http_host, s.http_port)
        if s.port_file:
            await asyncio.to_thread(_write_port_file, Path(s.port_file), self.port)
        if not s.jobs:
            log.warning(
                "health_monitor_idle",
                reason="no job to watch: pass --job NAME (repeatable) or --job-config FILE",
            )
            self._loaded.set()
        log.info(
            "health_monitor_started",
            jobs=s.jobs,
            http=f"{s.http_host}:{self.port}",
            heartbeat_interval_s=s.heartbeat_interval,
            heartbeat_timeout_s=s.heartbeat_timeout,
            startup_grace_s=s.grace,
            dedup_window_s=s.dedup_window,
            rules=s.rules,
            alert_rules=len(self.rules.rules),
            webhook_auth=s.webhook_token is not None,
        )

    async def wait_loaded(self, timeout: float) -> None:
        """Waits until every job's cluster state is loaded (for callers and tests)."""
        await asyncio.wait_for(self._loaded.wait(), timeout)

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        await cancel_and_wait(self._tasks, owner="health-monitor")
        self._tasks.clear()
        if self.emitter is not None:
            await self.emitter.stop()
        if self._side_tasks:
            await asyncio.wait(self._side_tasks, timeout=STOP_STEP_S)
        if self._nc is not None and self._given_nc is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.drain(), STOP_STEP_S)
            with contextlib.suppress(Exception):
                await self._nc.close()
        log.info("health_monitor_stopped")

    async def __aenter__(self) -> HealthMonitor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- cluster state -----------------------------------------------------------

    async def _follow_state(self, job: str) -> None:
        """Follows the job's cluster state; waits for the bucket and key to exist."""
        assert self._nc is not None
        js = self._nc.jetstream()
        delay = 0.05
        while True:
            try:
                kv = await bus.job_bucket(js, job)
                break
            except BucketNotFoundError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        async for state in follow_states(kv):
            if state.job != job:
                log.error("cluster_state_invalid", job=job, reason=f"names job {state.job!r}")
                continue
            self._apply_state(state)

    def _apply_state(self, state: ClusterState) -> None:
        assert self.emitter is not None
        job = state.job
        first = not self.roster.loaded(job)
        change: RosterChange = self.roster.update(state)
        now = time.monotonic()
        for machine in change.settled:
            self.tracker.unwatch(job, machine)
            self.stragglers.forget(job, machine)
            self.steps.forget(job, machine)
            if self.signals is not None:
                self.signals.forget(job, machine)
            self.emitter.settle(
                job, machine, f"machine is now {self.roster.status(job, machine) or 'removed'}"
            )
        for machine in change.started:
            self.tracker.watch(job, machine, now)
            log.info(
                "machine_watched",
                job=job,
                machine=machine,
                status=self.roster.status(job, machine),
                reason="status is watched; next heartbeat due within "
                f"{self.tracker.due_in(job, machine, now):.3g}s",
            )
        for machine in change.stopped:
            log.info(
                "machine_unwatched",
                job=job,
                machine=machine,
                reason=f"status is now {self.roster.status(job, machine) or 'removed'}",
            )
        active = self.roster.active(job)
        for machine in self.stragglers.machines(job):
            if machine not in active:
                self.stragglers.forget(job, machine)
        self.metrics.machines_watched.labels(job=job).set(self.tracker.watched_count(job))
        log.info(
            "cluster_state_loaded" if first else "cluster_state_updated",
            job=job,
            revision=state.revision,
            machines=len(state.machines),
            watched=self.tracker.watched_count(job),
        )
        if self.roster.all_loaded:
            self._loaded.set()

    # --- signals -----------------------------------------------------------------

    def _guard(self, handler: Callable[[str, Msg], None]) -> Callable[[Msg], Awaitable[None]]:
        """Wraps a subscription handler: finds the job and never lets an error escape."""

        async def run(msg: Msg) -> None:
            job = msg.subject.split(".")[1]
            try:
                if len(msg.data) > bus.MAX_PAYLOAD:
                    raise MessageError(
                        f"payload of {len(msg.data)} bytes exceeds {bus.MAX_PAYLOAD}"
                    )
                handler(job, msg)
            except MessageError as err:
                self._reject(job, msg.subject, msg.data, str(err), "invalid_message")
            except Exception as err:  # a bug in one message must not stop the subscription
                log.exception("signal_handler_failed", job=job, subject=msg.subject, error=str(err))

        return run

    # --- heartbeat deadlines -------------------------------------------------------

    async def _check_loop(self) -> None:
        assert self.signals is not None
        signals = self.signals
        tick = self.settings.tick
        expire_every = max(int(1.0 / tick), 1)
        n = 0
        deaf = False
        while True:
            await asyncio.sleep(tick)
            try:
                # While our own connection is down we hear nobody: that silence is ours,
                # not the machines' (a nats-server restart would otherwise fail them all).
                if self._nc is not None and not self._nc.is_connected:
                    deaf = True
                    continue
                if deaf:
                    deaf = False
                    self.tracker.rebase(time.monotonic())
                    log.info("heartbeat_deadlines_rebased", reason="reconnected to the bus")
                now = time.monotonic()
                signals.on_lapses(self.tracker.lapsed(now), now)
                n += 1
                if n % expire_every == 0 and self.emitter is not None:
                    self.emitter.expire()
                    for job in self.roster.jobs:
                        self.metrics.machines_up.labels(job=job).set(self.tracker.up_count(job))
            except Exception as err:  # keep checking whatever one lapse did
                log.exception("lapse_check_failed", error=str(err))

    # --- rejects -------------------------------------------------------------------

    def _reject(
        self,
        job: str | None,
        subject: str,
        payload: bytes,
        reason: str,
        category: str,
        key: str = "",
    ) -> None:
        """Logs a rejected input and dead-letters it, within the flood limits."""
        if not self.roster.jobs:
            self.metrics.dead_letters_suppressed.labels(category=category).inc()
            log.info("input_rejected", subject=subject, reason=reason, dead_letter="no job")
            return
        target = job if job in self.roster.jobs else self.roster.jobs[0]
        ident = (target, category, key or reason)
        now = time.monotonic()
        if not self._rejected.first(ident, now) or not self._reject_bucket.allow(now):
            self.metrics.dead_letters_suppressed.labels(category=category).inc()
            log.debug("input_rejected_again", job=target, subject=subject, reason=reason)
            return
        self.metrics.dead_letters.labels(job=target, category=category).inc()
        assert self._nc is not None
        task = asyncio.create_task(
            bus.dead_letter(self._nc.jetstream(), target, subject, payload, reason, SERVICE)
        )
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    # --- HTTP ------------------------------------------------------------------------

    def _on_http_reject(self, path: str, status: int) -> None:
        if path == "/webhook" or not path:
            outcome = {400: "bad_request", 413: "too_large", 503: "unavailable"}.get(
                status, f"http_{status}"
            )
            self.metrics.webhook_requests.labels(outcome=outcome).inc()

    async def _metrics_route(self, _request: web.Request) -> web.Response:
        for job in self.roster.jobs:
            self.metrics.machines_up.labels(job=job).set(self.tracker.up_count(job))
        return metrics_response(self.metrics.registry)

    async def _healthz_route(self, _request: web.Request) -> web.Response:
        connected = self._nc is not None and self._nc.is_connected
        ready = connected and self.roster.all_loaded
        body = {
            "status": "ok" if ready else "starting" if connected else "bus_disconnected",
            "bus_connected": connected,
            "bus_degraded": self._bus_health.degraded,
            "jobs": {j: self.roster.loaded(j) for j in self.roster.jobs},
            "open_incidents": len(self.emitter.table) if self.emitter else 0,
            "pending_publishes": self.emitter.pending if self.emitter else 0,
        }
        return json_response(200 if ready else 503, body)
