"""The real Prometheus (Debian's package) with deploy/'s scrape config scrapes TrainMover's
services and loads the shipped alert rules; promtool accepts the shipped files.

Prometheus runs on loopback with its own storage and the shipped scrape config with only
the targets pointed at this test's services (and a 1 s scrape interval); scrape jobs of
services this build does not run yet are left out."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml

from tests.integration.conftest import DEPLOY, LocalCluster, Services
from tests.integration.programs import Program, binary, http, http_ok, poll
from trainmover import metric_names

COVERS = ["prometheus/prometheus.yml", "prometheus/trainmover-alerts.yaml"]

SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "trainmover-alerts.yaml"

SCRAPE_JOB = {
    "health-monitor": "trainmover-health-monitor",
    "planner": "trainmover-planner",
    "executor": "trainmover-executor",
    "sidecar": "trainmover-machines",
}
"""Service -> its scrape job in deploy/prometheus/prometheus.yml."""


def render_config(service_ports: dict[str, int]) -> dict[str, Any]:
    """The shipped scrape config with loopback targets for the running services, the
    shipped rules by absolute path, no Alertmanager, and 1 s intervals."""
    config = yaml.safe_load(SCRAPE.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(SCRAPE.parent / f) for f in config["rule_files"]]
    config.pop("alerting")
    wanted = {SCRAPE_JOB[s]: port for s, port in service_ports.items()}
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] in wanted:
            job.pop("file_sd_configs", None)
            job["static_configs"] = [{"targets": [f"127.0.0.1:{wanted[job['job_name']]}"]}]
            jobs.append(job)
    assert len(jobs) == len(wanted), "a running service has no scrape job in prometheus.yml"
    config["scrape_configs"] = jobs
    return config  # type: ignore[no-any-return]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_shipped_rules() -> None:
    run = promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in run.stdout


def test_promtool_accepts_the_shipped_scrape_config() -> None:
    """As shipped (rule_files next to it; the file_sd file is the Slurm script's)."""
    run = promtool("check", "config", str(SCRAPE))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "is valid prometheus config file syntax" in run.stdout


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        status, body = http("GET", f"{self.url}/api/v1/query?query={quote(expr)}")
        assert status == 200, f"query {expr!r}: {status} {body!r}"
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]["result"]  # type: ignore[no-any-return]

    def value(self, expr: str) -> float | None:
        """The value of a query with one result, or None while it has none."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr}: {result}"
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
async def prometheus(trainmover_services: Services, tmp_path: Path) -> AsyncIterator[Prometheus]:
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(render_config(trainmover_services.ports)))
    check = await asyncio.to_thread(promtool, "check", "config", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    argv = [
        binary("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
        "--web.listen-address=127.0.0.1:0",
        "--log.level=warn",
    ]
    program = Program("prometheus", argv, tmp_path).start()
    try:
        url = f"http://127.0.0.1:{await program.bound_port()}"
        await poll(lambda: http_ok(f"{url}/-/ready"), "Prometheus to be ready")
        yield Prometheus(url)
    finally:
        program.stop()


async def test_prometheus_scrapes_trainmover_and_loads_the_rules(
    prometheus: Prometheus, trainmover_services: Services, local_cluster: LocalCluster
) -> None:
    job = local_cluster.job
    watched = len(local_cluster.machines) + len(local_cluster.standbys)

    # The health-monitor's machines, with the training job relabelled to trainmover_job
    # (the label the rules and the alert rules use) and `job` the scrape job.
    expr = (
        f'trainmover_health_machines_watched{{job="trainmover-health-monitor",'
        f'trainmover_job="{job}"}}'
    )
    assert await poll(lambda: prometheus.value(expr), "the health-monitor's metrics") == watched
    assert not prometheus.query('{__name__=~"trainmover_.+", exported_job!=""}')

    # Every running service is up and its own contract metrics are there.
    for service, scrape_job in ((s, SCRAPE_JOB[s]) for s in trainmover_services.ports):
        up = await poll(
            lambda j=scrape_job: prometheus.value(f'up{{job="{j}"}}'), f"{scrape_job} up"
        )
        assert up == 1, f"{scrape_job} is down"
        names = {
            r["metric"]["__name__"]
            for r in prometheus.query(f'{{__name__=~"trainmover_.+", job="{scrape_job}"}}')
        }
        # Histograms appear as their _bucket/_sum/_count series.
        exposed = {
            n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in names
        }
        assert exposed, f"no trainmover_* series scraped from {scrape_job}"
        if service in metric_names.BY_SERVICE:
            unknown = exposed - set(metric_names.BY_SERVICE[service])
            assert not unknown, (
                f"{service} exposes metrics not in trainmover.metric_names: {unknown}"
            )

    # The shipped alert rules are loaded and evaluate without errors.
    shipped = yaml.safe_load(RULES.read_text())["groups"]

    def evaluated() -> list[dict[str, Any]] | None:
        status, body = http("GET", f"{prometheus.url}/api/v1/rules")
        assert status == 200
        groups = json.loads(body)["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return groups if rules and all(r["health"] != "unknown" for r in rules) else None

    groups = await poll(evaluated, "the alert rules to be evaluated")
    assert [g["name"] for g in groups] == [g["name"] for g in shipped]
    for loaded, expected in zip(groups, shipped, strict=True):
        assert [r["name"] for r in loaded["rules"]] == [r["alert"] for r in expected["rules"]]
        for rule in loaded["rules"]:
            assert rule["health"] == "ok", rule
