"""The Alertmanager webhook over real HTTP, with the monitor in-process and the real bus.

Bodies follow Alertmanager's documented webhook payload (version "4"), see payloads.py.
"""

from __future__ import annotations

from nats.aio.client import Client as NatsClient

from tests.conftest import register_job
from trainmover.messages import DrainEvent, FailureEvent

from .conftest import MonitorFactory, dead_letters_of, events_of, http, is_event, metrics
from .payloads import RULES_FILE, alert, payload

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def start(monitor: MonitorFactory, nc: NatsClient, job: str):  # type: ignore[no-untyped-def]
    await register_job(nc, job)
    return await monitor("--rules", str(RULES_FILE), env={"TRAINMOVER_WEBHOOK_TOKEN": TOKEN})


async def test_firing_and_resolved(nc: NatsClient, job: str, monitor: MonitorFactory) -> None:
    hm = await start(monitor, nc, job)
    events = await events_of(nc, job)

    resolved = payload([alert("GPUXidError", status="resolved", node="m2")])
    reply = await http(hm.port, "/webhook", resolved, AUTH)
    assert reply.status == 200 and reply.json()["outcomes"] == {"resolved": 1}

    firing = payload(
        [alert("GPUXidError", instance="m1:9100", summary="Xid 79: GPU has fallen off the bus")]
    )
    reply = await http(hm.port, "/webhook", firing, AUTH)
    assert reply.status == 200 and reply.json()["outcomes"] == {"event": 1}
    # The answer comes after the bus acked the event.
    event = await events.wait_for(is_event("m1"))
    assert isinstance(event, FailureEvent) and event.source == "alertmanager"
    assert event.machine == "m1" and "Xid 79" in event.reason
    assert reply.json()["events"] == [event.event_id]
    assert [e.machine for e in events.items] == ["m1"]  # nothing for the resolved alert


async def test_grouped_alerts(nc: NatsClient, job: str, monitor: MonitorFactory) -> None:
    hm = await start(monitor, nc, job)
    events = await events_of(nc, job)
    body = payload(
        [
            alert("NodePlannedMaintenance", node="m2", drain_deadline="10m", team="infra"),
            alert("NodePlannedMaintenance", node="m3", team="infra"),
            alert("NodePlannedMaintenance", node="m0", status="resolved", team="infra"),
            alert("GPUXidError", hostname="s0.dc1.example.com", trainmover_job=job),
        ]
    )
    reply = await http(hm.port, "/webhook", body, AUTH)
    assert reply.status == 200
    assert reply.json()["outcomes"] == {"event": 3, "resolved": 1}
    await events.wait_count(3)
    by_machine = {e.machine: e for e in events.items}
    assert sorted(by_machine) == ["m2", "m3", "s0"]
    assert isinstance(by_machine["m2"], DrainEvent) and by_machine["m2"].deadline_s == 600
    assert isinstance(by_machine["m3"], DrainEvent) and by_machine["m3"].deadline_s == 3600
    assert isinstance(by_machine["s0"], FailureEvent)  # a standby with a dead GPU


async def test_unknown_machine_and_unmapped_alert_are_acknowledged_and_dead_lettered(
    nc: NatsClient, job: str, monitor: MonitorFactory
) -> None:
    hm = await start(monitor, nc, job)
    letters = await dead_letters_of(nc, job)
    events = await events_of(nc, job)

    reply = await http(hm.port, "/webhook", payload([alert("GPUXidError", node="gpu-99")]), AUTH)
    assert reply.status == 200 and reply.json()["outcomes"] == {"unknown_machine": 1}
    letter = await letters.wait_for(lambda d: "gpu-99" in d.reason)
    assert "unknown machine 'gpu-99'" in letter.reason
    assert letter.subject == "http POST /webhook" and '"gpu-99"' in letter.payload

    reply = await http(hm.port, "/webhook", payload([alert("DiskFull", node="m1")]), AUTH)
    assert reply.status == 200 and reply.json()["outcomes"] == {"unmapped": 1}
    letter = await letters.wait_for(lambda d: "DiskFull" in d.reason)
    assert letter.reason == "no rule maps alertname 'DiskFull'"
    assert letter.job == job  # found through the alert's machine label

    assert events.items == []
    scraped = await metrics(hm.port)
    assert scraped['trainmover_health_alerts_total{outcome="unknown_machine"}'] == 1
    assert scraped['trainmover_health_alerts_total{outcome="unmapped"}'] == 1


async def test_malformed_body_and_wrong_token(
    nc: NatsClient, job: str, monitor: MonitorFactory
) -> None:
    hm = await start(monitor, nc, job)
    good = payload([alert("GPUXidError", node="m1")])

    reply = await http(hm.port, "/webhook", b'{"version": "4", "status": ', AUTH)
    assert reply.status == 400
    text = reply.body.decode()
    assert text.startswith("malformed JSON") and text.count("\n") == 1

    reply = await http(hm.port, "/webhook", b'{"version": "4", "status": "firing"}', AUTH)
    assert reply.status == 400 and "field 'alerts'" in reply.body.decode()

    for headers in ({"Authorization": "Bearer wrong"}, {}, {"Authorization": f"Basic {TOKEN}"}):
        reply = await http(hm.port, "/webhook", good, headers)
        assert reply.status == 401

    assert (await http(hm.port, "/webhook", method="GET")).status == 405
    assert (await http(hm.port, "/nope")).status == 404
    health = await http(hm.port, "/healthz")
    assert health.status == 200 and health.json()["status"] == "ok"

    scraped = await metrics(hm.port)
    assert scraped['trainmover_health_webhook_requests_total{outcome="bad_request"}'] == 2
    assert scraped['trainmover_health_webhook_requests_total{outcome="unauthorized"}'] == 3


async def test_repeated_alert_is_one_event(
    nc: NatsClient, job: str, monitor: MonitorFactory
) -> None:
    hm = await start(monitor, nc, job)
    events = await events_of(nc, job)
    body = payload([alert("GPUXidError", node="m1")])
    outcomes = []
    for _ in range(3):  # Alertmanager's repeat_interval re-sends the same notification
        reply = await http(hm.port, "/webhook", body, AUTH)
        outcomes.append(reply.json()["outcomes"])
    # Another alert about the same machine and kind is the same incident.
    other = payload([alert("NodeDown", node="m1", severity="critical")])
    outcomes.append((await http(hm.port, "/webhook", other, AUTH)).json()["outcomes"])
    assert outcomes == [{"event": 1}, {"duplicate": 1}, {"duplicate": 1}, {"duplicate": 1}]
    # A drain of the same machine is a different kind: its own event. Sentinel too.
    drain = payload([alert("NodePlannedMaintenance", node="m1")])
    assert (await http(hm.port, "/webhook", drain, AUTH)).json()["outcomes"] == {"event": 1}
    await events.wait_count(2)
    assert [(e.machine, e.kind) for e in events.items] == [("m1", "failure"), ("m1", "drain")]
