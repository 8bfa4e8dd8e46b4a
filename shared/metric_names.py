"""The Prometheus metric names (and their labels) that TrainMover's services expose.

One place for the public metric contract: the services register these names, and the
alert rules, scrape configs and docs in deploy/ and docs/ use them (tests/deploy checks
the shipped rules against this module). Changing a name here is a breaking change for
every operator's dashboards and alerts.

Label sets list the labels each service puts on a sample. The scrape configs in deploy/
rename a metric's own `job` label (the training job) to `trainmover_job`, because
Prometheus reserves `job` for the scrape job.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from trainmover.messages import TERMINAL_STATES

# --- every service on the bus (trainmover.bushealth) ------------------------------------
BUS_DEGRADED: Final = "trainmover_bus_degraded"
"""1 while the service's bus cannot take durable writes (no quorum, no stream leader,
its connection down); 0 otherwise."""

ON_BUS: Final = MappingProxyType({BUS_DEGRADED: ()})
"""What every service connected to the bus exposes too (the rendezvous is not on it)."""

# --- health-monitor (services/health_monitor/metrics.py registers these) -------------
HEALTH: Final = MappingProxyType(
    {
        **ON_BUS,
        "trainmover_health_heartbeats_total": ("job",),
        "trainmover_health_machines_up": ("job",),
        "trainmover_health_machines_watched": ("job",),
        "trainmover_health_step_stats_total": ("job",),
        "trainmover_health_events_total": ("job", "kind", "source"),
        "trainmover_health_duplicates_total": ("job", "kind", "source"),
        "trainmover_health_dead_letters_total": ("job", "category"),
        "trainmover_health_dead_letters_suppressed_total": ("category",),
        "trainmover_health_webhook_requests_total": ("outcome",),
        "trainmover_health_alerts_total": ("outcome",),
        "trainmover_health_detection_latency_seconds": ("source",),
        "trainmover_health_open_incidents": (),
        "trainmover_health_pending_publishes": (),
        "trainmover_health_publish_errors_total": (),
        "trainmover_health_stalls_excused_total": ("job",),
        "trainmover_health_silences_held_total": ("job",),
    }
)

# --- planner -------------------------------------------------------------------------
PLANNER_DECISIONS: Final = "trainmover_planner_decisions_total"
PLANNER_PLANS: Final = "trainmover_planner_plans_total"
PLANNER_PLAN_LATENCY: Final = "trainmover_planner_plan_latency_seconds"
STANDBY_POOL_SIZE: Final = "trainmover_standby_pool_size"
"""Standby machines warm and free; 0 means the next failure falls back to a restart."""

PLANNER: Final = MappingProxyType(
    {
        PLANNER_DECISIONS: ("outcome",),
        PLANNER_PLANS: ("kind",),
        PLANNER_PLAN_LATENCY: (),
        STANDBY_POOL_SIZE: (),
        **ON_BUS,
    }
)

# --- executor ------------------------------------------------------------------------
MIGRATIONS: Final = "trainmover_migrations_total"
MIGRATION_DOWNTIME: Final = "trainmover_migration_downtime_seconds"
"""Histogram of each migration's downtime (docs/operations.md defines downtime)."""
MIGRATION_PHASE: Final = "trainmover_migration_phase_seconds"

EXECUTOR: Final = MappingProxyType(
    {
        MIGRATIONS: ("kind", "outcome"),
        MIGRATION_DOWNTIME: (),
        MIGRATION_PHASE: ("phase",),
        **ON_BUS,
    }
)

# --- rendezvous (services/rendezvous/service.py) ----------------------------------------
RENDEZVOUS_KEYS: Final = "trainmover_rendezvous_keys"
"""Keys in the job's rendezvous store (set by each /healthz probe)."""

RENDEZVOUS_SERVING: Final = "trainmover_rendezvous_serving"
"""1 while this replica of the store serves the job, 0 while it stands by."""

RENDEZVOUS: Final = MappingProxyType({RENDEZVOUS_KEYS: (), RENDEZVOUS_SERVING: ()})

# --- sidecar (services/sidecar/service.py), one per machine ----------------------------
SIDECAR_COMMANDS: Final = "trainmover_sidecar_commands_total"
SIDECAR_STEP: Final = "trainmover_sidecar_step"
"""The machine's last training step (the dashboard's step rate)."""

SIDECAR: Final = MappingProxyType({SIDECAR_COMMANDS: ("op", "outcome"), SIDECAR_STEP: (), **ON_BUS})

MIGRATION_OUTCOMES: Final = tuple(sorted(TERMINAL_STATES))
"""Values of `outcome` on MIGRATIONS: the terminal states of a migration."""
FAILED_OUTCOMES: Final = ("aborted", "failed")
"""Outcomes that mean the job did not get its machine moved (alert on these)."""

SLOW_MIGRATION_S: Final = 60.0
"""A migration with more downtime than this is slow (alert TrainMoverMigrationSlow)."""

MIGRATION_DOWNTIME_BUCKETS: Final = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
"""Buckets of MIGRATION_DOWNTIME: sub-second on small jobs; the published approach does
~16 s (planned) and ~21 s (unplanned) at 1,024 GPUs; SLOW_MIGRATION_S must be one of
them, so the slow-migration alert can count the migrations above it exactly."""

ALL: Final = MappingProxyType({**HEALTH, **PLANNER, **EXECUTOR, **RENDEZVOUS, **SIDECAR})
"""Every metric name -> its labels."""

BY_SERVICE: Final = MappingProxyType(
    {
        "health-monitor": HEALTH,
        "planner": PLANNER,
        "executor": EXECUTOR,
        "rendezvous": RENDEZVOUS,
        "sidecar": SIDECAR,
    }
)
