"""deploy/grafana/trainmover-dashboard.json: every query reads metrics the services
export (trainmover.metric_names) with labels they carry, and the dashboard covers what
an operator watches: downtime, phases, step rate, standby pool, dead letters."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.deploy.files import DEPLOY
from tests.deploy.test_monitoring_files import TARGET_LABELS, trainmover_metrics_in
from trainmover import metric_names

COVERS = ["grafana/trainmover-dashboard.json"]
DASHBOARD = DEPLOY / COVERS[0]


def panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]


def test_every_query_reads_exported_metrics_and_their_labels() -> None:
    assert queries()
    for title, expr in queries():
        used = trainmover_metrics_in(expr)
        assert used, f"{title}: {expr} reads no trainmover metric"
        unknown = used - set(metric_names.ALL)
        assert not unknown, f"{title}: {unknown} are not exported (trainmover.metric_names)"
        allowed = TARGET_LABELS.union(*(metric_names.ALL[m] for m in used))
        for label in re.findall(r"\b([a-z_]+)\s*(?:=~|!~|!=|=)\s*\"", expr):
            assert label in allowed, f"{title}: label {label} not on {used}"
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                assert label in allowed, f"{title}: by ({label}) not on {used}"


def test_the_dashboard_covers_migrations_step_rate_pool_and_dead_letters() -> None:
    read = set().union(*(trainmover_metrics_in(e) for _, e in queries()))
    assert {
        metric_names.MIGRATION_DOWNTIME,
        metric_names.MIGRATION_PHASE,
        metric_names.SIDECAR_STEP,
        metric_names.STANDBY_POOL_SIZE,
        "trainmover_health_dead_letters_total",
    } <= read


def test_panels_are_well_formed() -> None:
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    for p in panels():
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"][
            "w"
        ] <= 24
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
