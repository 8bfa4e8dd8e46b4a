"""POST /webhook: Alertmanager notifications -> interruption events.

For each alert of a notification, in order: a resolved alert creates nothing; an alert
no rule maps, or whose machine the cluster states do not know, is acknowledged and
dead-lettered with the reason; an alert for a machine already settled (failed,
maintenance; or leaving, for a drain) is acknowledged and ignored; anything else is
proposed to the emitter, which folds repeats into the open incident. The answer comes
after the new events are acked by the bus (200), so an acknowledged alert is durable;
if that takes too long the answer is 503 and Alertmanager retries (its repeats are
duplicates by then). Answers: 400 for a malformed body, 401 for a wrong token, 503
while a job's cluster state is not loaded yet.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime

from aiohttp import web

from trainmover.httpserver import json_response, read_body, text
from trainmover.logs import get_logger
from trainmover.messages import DrainEvent, FailureEvent
from trainmover.services.health_monitor.alertmanager import Alert, PayloadError, parse_payload
from trainmover.services.health_monitor.emitter import Emitter
from trainmover.services.health_monitor.events import event_id
from trainmover.services.health_monitor.metrics import HealthMetrics
from trainmover.services.health_monitor.roster import Roster
from trainmover.services.health_monitor.rules import RuleSet, Unmapped

log = get_logger("health-monitor")

WEBHOOK_SUBJECT = "http POST /webhook"
"""The `subject` of dead letters from the webhook (they did not come over NATS)."""

Reject = Callable[[str | None, str, bytes, str, str], None]
"""(job or None, subject, payload, reason, category) -> records a dead letter."""


def parse_time(text: str) -> float | None:
    """Unix seconds of an Alertmanager RFC 3339 time (nanoseconds allowed); None if unset."""
    if not text or text.startswith("0001-"):
        return None
    text = text.replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:  # Go writes up to 9 fractional digits; Python reads 6
        digits = len(rest) - len(rest.lstrip("0123456789"))
        text = f"{head}.{rest[: min(digits, 6)]}{rest[digits:]}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


class WebhookHandler:
    """The /webhook route; stateless apart from what it reads and proposes."""

    def __init__(
        self,
        *,
        rules: RuleSet,
        roster: Roster,
        emitter: Emitter,
        reject: Reject,
        metrics: HealthMetrics,
        token: str | None,
        publish_timeout: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._rules = rules
        self._roster = roster
        self._emitter = emitter
        self._reject = reject
        self._metrics = metrics
        self._token = token
        self._publish_timeout = publish_timeout
        self._clock = clock

    def _answer(self, outcome: str, response: web.Response) -> web.Response:
        self._metrics.webhook_requests.labels(outcome=outcome).inc()
        return response

    async def __call__(self, request: web.Request) -> web.Response:
        if self._token is not None:
            given = request.headers.get("authorization", "")
            scheme, _, credential = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                credential.strip().encode(), self._token.encode()
            ):
                log.warning("webhook_unauthorized", reason="missing or wrong bearer token")
                return self._answer(
                    "unauthorized",
                    text(
                        401,
                        "unauthorized: wrong or missing bearer token",
                        **{"WWW-Authenticate": "Bearer"},
                    ),
                )
        try:
            payload = parse_payload(await read_body(request))
        except PayloadError as err:
            log.warning("webhook_bad_request", reason=str(err))
            return self._answer("bad_request", text(400, str(err)))
        missing = [j for j in self._roster.jobs if not self._roster.loaded(j)]
        if missing:
            reason = f"cluster state of job(s) {', '.join(missing)} not loaded yet; retry"
            log.warning("webhook_unavailable", reason=reason)
            return self._answer("unavailable", text(503, reason))

        outcomes: Counter[str] = Counter()
        events: list[str] = []
        waits: list[asyncio.Future[None]] = []
        now = self._clock()
        for alert in payload.alerts:
            outcome, eid, fut = self._handle(alert, payload.receiver, now)
            outcomes[outcome] += 1
            self._metrics.alerts.labels(outcome=outcome).inc()
            if eid is not None and outcome == "event":
                events.append(eid)
            if fut is not None:
                waits.append(fut)
        if waits:
            try:
                await asyncio.wait_for(
                    asyncio.shield(asyncio.gather(*waits)), self._publish_timeout
                )
            except TimeoutError:
                reason = f"events not acked by the bus within {self._publish_timeout:g}s; retry"
                log.warning("webhook_unavailable", reason=reason, events=len(waits))
                return self._answer("unavailable", text(503, reason))
        log.info(
            "webhook_handled",
            receiver=payload.receiver,
            status=payload.status,
            alerts=len(payload.alerts),
            outcomes=dict(outcomes),
        )
        return self._answer(
            "ok",
            json_response(
                200, {"alerts": len(payload.alerts), "outcomes": outcomes, "events": events}
            ),
        )

    def _handle(
        self, alert: Alert, receiver: str, now: float
    ) -> tuple[str, str | None, asyncio.Future[None] | None]:
        """Decides one alert: (outcome, event id, future of its publish)."""
        ctx = {"alertname": alert.alertname, "fingerprint": alert.fingerprint}
        raw = alert.model_dump_json().encode()
        if alert.status == "resolved":
            log.info("alert_resolved", **ctx, reason="resolved alerts create no event")
            return "resolved", None, None
        try:
            mapping = self._rules.map(alert, now)
        except Unmapped as err:
            job = self._guess_job(alert)
            self._reject(job, WEBHOOK_SUBJECT, raw, str(err), err.category)
            return err.category, None, None
        machine = mapping.machine
        if mapping.job is not None:
            if mapping.job not in self._roster.jobs:
                reason = f"alert names job {mapping.job!r}, which this monitor does not watch"
                self._reject(None, WEBHOOK_SUBJECT, raw, reason, "unknown_job")
                return "unknown_job", None, None
            jobs = [mapping.job] if self._roster.status(mapping.job, machine) else []
        else:
            jobs = self._roster.jobs_of(machine)
        if not jobs:
            where = mapping.job or ", ".join(self._roster.jobs)
            reason = f"unknown machine {machine!r}: not in the cluster state of {where}"
            self._reject(mapping.job, WEBHOOK_SUBJECT, raw, reason, "unknown_machine")
            return "unknown_machine", None, None
        if len(jobs) > 1:
            reason = f"machine {machine!r} is in several jobs ({', '.join(jobs)}): set job_label"
            self._reject(jobs[0], WEBHOOK_SUBJECT, raw, reason, "ambiguous_machine")
            return "ambiguous_machine", None, None
        job = jobs[0]
        status = self._roster.status(job, machine)
        settled = not self._roster.is_watched(job, machine) or (
            mapping.kind == "drain" and status == "leaving"
        )
        if settled:
            log.info(
                "alert_ignored",
                **ctx,
                job=job,
                machine=machine,
                kind=mapping.kind,
                reason=f"machine is already {status}",
            )
            return "ignored", None, None
        anchor = f"alert:{alert.fingerprint or sorted(alert.labels.items())}:{alert.startsAt}"
        summary = alert.annotations.get("summary") or alert.annotations.get("description") or ""
        reason = f"alert {alert.alertname} via Alertmanager receiver {receiver!r}"
        if summary:
            reason += f": {summary}"
        common = dict(
            event_id=event_id(job, machine, mapping.kind, anchor),
            job=job,
            machine=machine,
            reason=reason[:4096],
            source="alertmanager",
        )
        event: DrainEvent | FailureEvent = (
            DrainEvent(**common, deadline_s=mapping.deadline_s)  # type: ignore[arg-type]
            if mapping.kind == "drain"
            else FailureEvent(**common)  # type: ignore[arg-type]
        )
        outcome, incident, fut = self._emitter.propose(event, alive_ts=parse_time(alert.startsAt))
        return ("event" if outcome == "emitted" else "duplicate"), incident.event_id, fut

    def _guess_job(self, alert: Alert) -> str | None:
        """The job a rejected alert most likely concerns, for its dead letter."""
        for value in alert.labels.values():
            jobs = self._roster.jobs_of(value)
            if len(jobs) == 1:
                return jobs[0]
        return None
