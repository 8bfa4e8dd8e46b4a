"""deploy/prometheus/ and deploy/alertmanager/ against the code: metric names and labels,
ports, scrape job names, the health-monitor's rules file and its real alert mapping.

The real programs check the same files in tests/integration (promtool, amtool, and
Prometheus and Alertmanager themselves)."""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.deploy.files import DEPLOY, find, load_yaml
from tests.deploy.test_contract import slow_le
from trainmover import metric_names, ports
from trainmover.services.health_monitor.alertmanager import Alert
from trainmover.services.health_monitor.rules import load_rules

COVERS = [
    "prometheus/prometheus.yml",
    "prometheus/trainmover-alerts.yaml",
    "alertmanager/alertmanager.yml",
    "health-monitor-rules.yaml",
]

SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "trainmover-alerts.yaml"
ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"
RULES = DEPLOY / "health-monitor-rules.yaml"

SCRAPE_JOBS = {
    "trainmover-health-monitor": "health-monitor",
    "trainmover-planner": "planner",
    "trainmover-executor": "executor",
    "trainmover-machines": "sidecar",
}
"""Scrape job -> the service it scrapes; the names are the Kubernetes Services' names, so
a ServiceMonitor and this file give the same `job` label."""

# Labels an alert expression may use besides a metric's own: Prometheus's target labels
# and the relabelled training job.
TARGET_LABELS = {"job", "instance", "trainmover_job", "le"}


def alert_rules() -> dict[str, dict[str, Any]]:
    groups = load_yaml(ALERTS)["groups"]
    return {r["alert"]: {**r, "group": g["name"]} for g in groups for r in g["rules"]}


def trainmover_metrics_in(expr: str) -> set[str]:
    """Metric names (histogram series folded to the histogram) an expression reads."""
    names = set(re.findall(r"\btrainmover_[a-z_]+", expr)) - {"trainmover_job"}
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_scrape_jobs_target_the_service_ports() -> None:
    config = load_yaml(SCRAPE)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == set(SCRAPE_JOBS)
    for name, service in SCRAPE_JOBS.items():
        job = jobs[name]
        assert job["metrics_path"] == ports.METRICS_PATH
        relabel = job["metric_relabel_configs"]
        assert relabel[0] == {"source_labels": ["exported_job"], "target_label": "trainmover_job"}
        assert relabel[1] == {"action": "labeldrop", "regex": "exported_job"}
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert host == name, "static targets are named like the Kubernetes Service"
                assert int(port) == ports.DEFAULT_HTTP_PORTS[service]
        if service != "sidecar":
            assert find("Service", name)
    # The sidecars come from the file the Slurm script writes (tests/deploy/test_slurm.py).
    assert jobs["trainmover-machines"]["file_sd_configs"][0]["files"]
    assert config["rule_files"] == [ALERTS.name]


def test_alert_rules_use_only_contract_metrics_and_labels() -> None:
    for name, rule in alert_rules().items():
        expr = rule["expr"]
        used = trainmover_metrics_in(expr)
        unknown = used - set(metric_names.ALL)
        assert not unknown, f"{name}: unknown metrics {unknown} (trainmover.metric_names)"
        if used:
            allowed = TARGET_LABELS.union(*(metric_names.ALL[m] for m in used))
            for label in re.findall(r"\b([a-z_]+)\s*(?:=~|!~|!=|=)\s*\"", expr):
                assert label in allowed, f"{name}: label {label} not on {used}"
            for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
                for label in (g.strip() for g in group.split(",")):
                    assert label in allowed, f"{name}: by ({label}) not on {used}"


def test_trainmover_self_alerts() -> None:
    rules = alert_rules()
    assert trainmover_metrics_in(rules["TrainMoverNoStandbyFree"]["expr"]) == {
        metric_names.STANDBY_POOL_SIZE
    }
    failed = rules["TrainMoverMigrationFailed"]["expr"]
    assert trainmover_metrics_in(failed) == {metric_names.MIGRATIONS}
    (outcomes,) = re.findall(r'outcome=~"([^"]+)"', failed)
    assert sorted(outcomes.split("|")) == sorted(metric_names.FAILED_OUTCOMES)
    slow = rules["TrainMoverMigrationSlow"]["expr"]
    assert trainmover_metrics_in(slow) == {metric_names.MIGRATION_DOWNTIME}
    assert f'le="{slow_le()}"' in slow and 'le="+Inf"' in slow
    down = rules["TrainMoverServiceDown"]["expr"]
    (jobs,) = re.findall(r'job=~"([^"]+)"', down)
    assert set(jobs.split("|")) == set(SCRAPE_JOBS) - {"trainmover-machines"}
    for rule in rules.values():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"]


@pytest.mark.parametrize(
    ("alertname", "kind"), [("GPUXidError", "failure"), ("NodePlannedMaintenance", "drain")]
)
def test_input_alerts_map_to_events_by_the_shipped_rules(alertname: str, kind: str) -> None:
    """The health-monitor's real rule set maps an alert with the labels this rule
    produces to the event the design asks for (Xid -> failure, maintenance -> drain with
    the deadline from the annotation)."""
    rule = alert_rules()[alertname]
    assert rule["group"] == "trainmover-inputs"
    rules = load_rules(RULES)
    # `node` is set by the expression (label_replace) or by the metric itself.
    labels = {**rule["labels"], "alertname": alertname, "node": "gpu-07"}
    annotations = {k: "600" for k in rule["annotations"] if k == rules.deadline_annotation}
    alert = Alert(status="firing", labels=labels, annotations=annotations)
    mapping = rules.map(alert, time.time())
    assert (mapping.kind, mapping.machine) == (kind, "gpu-07")
    if kind == "drain":
        assert rules.deadline_annotation in rule["annotations"]
        assert mapping.deadline_s == 600
    if "label_replace" in rule["expr"]:
        assert '"node"' in rule["expr"]


def test_alertmanager_routes_the_mapped_alerts_to_the_health_monitor() -> None:
    config = load_yaml(ALERTMANAGER)
    (route,) = [r for r in config["route"]["routes"] if r["receiver"] == "trainmover"]
    (matcher,) = route["matchers"]
    names = re.fullmatch(r'alertname=~"([^"]+)"', matcher)
    assert names, matcher
    mapped = {r.alertname for r in load_rules(RULES).rules}
    assert set(names.group(1).split("|")) == mapped
    # Every alert TrainMover ships for itself goes to humans, never to the webhook.
    own = {n for n, r in alert_rules().items() if r["group"] == "trainmover-self"}
    inputs = {n for n, r in alert_rules().items() if r["group"] == "trainmover-inputs"}
    assert not own & mapped and inputs <= mapped
    assert route["continue"] is True
    assert "node" in route["group_by"]


def test_alertmanager_webhook_points_at_the_health_monitor_service() -> None:
    config = load_yaml(ALERTMANAGER)
    (receiver,) = [r for r in config["receivers"] if r["name"] == "trainmover"]
    (hook,) = receiver["webhook_configs"]
    url = urlsplit(hook["url"])
    svc = find("Service", "trainmover-health-monitor")
    assert url.hostname == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert url.port == svc["spec"]["ports"][0]["port"] == ports.DEFAULT_HTTP_PORTS["health-monitor"]
    assert url.path == ports.WEBHOOK_PATH
    auth = hook["http_config"]["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials_file"].startswith("/")
    assert hook["send_resolved"] is True
