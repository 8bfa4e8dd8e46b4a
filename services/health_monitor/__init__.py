"""The health-monitor service: turns heartbeats, worker exits, collective errors, step
statistics and Alertmanager alerts into interruption events (failure, drain, straggler).

    trainmover service health-monitor --job job1 --rules deploy/health-monitor-rules.yaml
    python -m trainmover.services.health_monitor --job job1

Modules, one job each:
    config        settings from flags, environment and files
    heartbeats    heartbeat deadlines and abnormal worker exits (pure)
    stragglers    straggler detection with hysteresis (pure)
    alertmanager  the Alertmanager webhook payload, version 4 (pure)
    rules         the alert rules file and alert -> event mapping (pure)
    roster        which machines exist and are watched, from cluster states (pure)
    dedup         incident table, bounded seen-window, token bucket (pure)
    events        deterministic event ids (pure)
    store         open incidents persisted in the job's health bucket
    signals       heartbeats, step stats, collective errors, stalls, lapses -> events
    emitter       one event per incident, published durably
    webhook       POST /webhook
    httpserver    the HTTP endpoints (aiohttp) with flood and slow-client limits
    metrics       the service's Prometheus metrics
    service       wiring of all of the above
    bench         detection-latency benchmark (a command, not a test)
    heartbeater   a stand-in sidecar that only heartbeats (benchmark and tests)
"""

from __future__ import annotations

from trainmover.service import run_service


def main(argv: list[str] | None = None) -> int:
    """Runs the service until SIGINT/SIGTERM; exit 2 for bad settings, 1 for bus errors."""
    from trainmover.services.health_monitor.config import ConfigError, load
    from trainmover.services.health_monitor.rules import RulesError
    from trainmover.services.health_monitor.service import HealthMonitor

    return run_service(
        "health-monitor", lambda: load(argv), HealthMonitor, (ConfigError, RulesError)
    )


__all__ = ["main"]
