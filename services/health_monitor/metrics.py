"""The health-monitor's metrics, served at /metrics (names are the public contract)."""

from __future__ import annotations

from trainmover.bushealth import degraded_gauge
from trainmover.metrics import Registry

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class HealthMetrics:
    """Every metric of the service, in one registry."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.bus_degraded = degraded_gauge(r)
        self.heartbeats = r.counter(
            "trainmover_health_heartbeats_total", "Heartbeats received from sidecars", ["job"]
        )
        self.machines_up = r.gauge(
            "trainmover_health_machines_up",
            "Watched machines whose heartbeats are on time",
            ["job"],
        )
        self.machines_watched = r.gauge(
            "trainmover_health_machines_watched", "Machines watched for heartbeats", ["job"]
        )
        self.step_stats = r.counter(
            "trainmover_health_step_stats_total", "Step statistics received", ["job"]
        )
        self.events = r.counter(
            "trainmover_health_events_total",
            "Interruption events published, by kind and source",
            ["job", "kind", "source"],
        )
        self.duplicates = r.counter(
            "trainmover_health_duplicates_total",
            "Signals folded into an already open incident, by kind and source",
            ["job", "kind", "source"],
        )
        self.dead_letters = r.counter(
            "trainmover_health_dead_letters_total",
            "Rejected inputs published to the dead-letter subject, by reason category",
            ["job", "category"],
        )
        self.dead_letters_suppressed = r.counter(
            "trainmover_health_dead_letters_suppressed_total",
            "Rejected inputs only counted (repeats, or over the dead-letter rate limit)",
            ["category"],
        )
        self.webhook_requests = r.counter(
            "trainmover_health_webhook_requests_total",
            "Alertmanager webhook requests, by outcome",
            ["outcome"],
        )
        self.alerts = r.counter(
            "trainmover_health_alerts_total",
            "Alerts received on the webhook, by outcome",
            ["outcome"],
        )
        self.detection_latency = r.histogram(
            "trainmover_health_detection_latency_seconds",
            "From the last sign of life (last heartbeat, or the report's timestamp) "
            "to the event's publish ack",
            ["source"],
            buckets=LATENCY_BUCKETS,
        )
        self.open_incidents = r.gauge(
            "trainmover_health_open_incidents", "Incidents inside their dedup window"
        )
        self.pending_publishes = r.gauge(
            "trainmover_health_pending_publishes", "Events decided but not yet acked by the bus"
        )
        self.stalls_excused = r.counter(
            "trainmover_health_stalls_excused_total",
            "Machines named silent by a stall report whose heartbeats showed them starved "
            "of a CPU, not stopped (not declared failed)",
            ["job"],
        )
        self.silences_held = r.counter(
            "trainmover_health_silences_held_total",
            "Lapsed machines not failed from silence alone: too many of the job were silent "
            "at once (a host or bus problem until a peer or the progress board names one)",
            ["job"],
        )
        self.publish_errors = r.counter(
            "trainmover_health_publish_errors_total", "Failed publish attempts (retried)"
        )
