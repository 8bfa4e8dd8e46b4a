"""trainmover.ports and trainmover.metric_names agree with the code that exists."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client.utils import floatToGoString

from tests.deploy.files import ROOT
from trainmover import metric_names, ports
from trainmover.cli import CliError, service_main
from trainmover.metrics import Registry, parse_text, render
from trainmover.services.health_monitor import config as hm_config
from trainmover.services.health_monitor.metrics import HealthMetrics


def available(service: str) -> bool:
    try:
        service_main(service)
    except CliError:
        return False
    return True


def test_health_monitor_parser_has_every_contract_flag() -> None:
    options = {s for action in hm_config.parser()._actions for s in action.option_strings}
    missing = ports.SERVICE_FLAGS["health-monitor"] - options
    assert not missing, f"health-monitor lacks contract flags {sorted(missing)}"


def test_health_monitor_default_port_is_the_contract_port() -> None:
    assert hm_config.Settings().http_port == ports.DEFAULT_HTTP_PORTS["health-monitor"]
    assert hm_config.TOKEN_ENV == ports.WEBHOOK_TOKEN_ENV


def test_ports_are_distinct_and_every_service_has_one() -> None:
    assert set(ports.DEFAULT_HTTP_PORTS) == set(ports.SERVICES) == set(ports.SERVICE_FLAGS)
    assert len(set(ports.DEFAULT_HTTP_PORTS.values())) == len(ports.SERVICES)
    assert ports.SWITCHES <= ports.SERVICE_FLAGS["sidecar"]


@pytest.mark.parametrize("service", ports.SERVICES)
def test_each_built_service_accepts_the_contract_flags(service: str) -> None:
    """A service this build has must list every contract flag in its --help; one not
    built yet must say so (the check then applies as soon as it lands)."""
    run = subprocess.run(
        [sys.executable, "-m", "trainmover.cli", "service", service, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    if available(service):
        assert run.returncode == 0, run.stderr
        missing = [f for f in sorted(ports.SERVICE_FLAGS[service]) if f not in run.stdout]
        assert not missing, f"`trainmover service {service} --help` lacks {missing}"
    else:
        assert run.returncode == 2 and "not available in this build yet" in run.stderr


def test_health_metric_names_are_the_registered_ones() -> None:
    assert HealthMetrics().registry.declared == dict(metric_names.HEALTH)


def test_every_metric_name_is_unique_and_prefixed() -> None:
    """A name belongs to one service, but for those every service on the bus has."""
    shared = set(metric_names.ON_BUS)
    names = [
        n
        for service in metric_names.BY_SERVICE.values()
        for n, labels in service.items()
        if n not in shared or labels != metric_names.ON_BUS[n]
    ]
    assert len(names) + len(shared) == len(set(names) | shared) == len(metric_names.ALL)
    assert all(n.startswith("trainmover_") for n in metric_names.ALL)
    on_bus = [s for s, names in metric_names.BY_SERVICE.items() if shared <= set(names)]
    assert sorted(on_bus) == ["executor", "health-monitor", "planner", "sidecar"]


def test_slow_migration_threshold_is_a_downtime_bucket() -> None:
    """The slow-migration alert subtracts the bucket at the threshold from +Inf, so the
    threshold must be a bucket, written the way the registry writes `le`."""
    assert metric_names.SLOW_MIGRATION_S in metric_names.MIGRATION_DOWNTIME_BUCKETS
    registry = Registry()
    hist = registry.histogram(
        metric_names.MIGRATION_DOWNTIME, "", (), metric_names.MIGRATION_DOWNTIME_BUCKETS
    )
    hist.observe(metric_names.SLOW_MIGRATION_S)
    scraped = parse_text(render(registry).decode())
    assert f'{metric_names.MIGRATION_DOWNTIME}_bucket{{le="{slow_le()}"}}' in scraped


def slow_le() -> str:
    """The `le` label value of the SLOW_MIGRATION_S bucket, as exposed."""
    return floatToGoString(metric_names.SLOW_MIGRATION_S)


def test_failed_outcomes_are_terminal_states() -> None:
    assert set(metric_names.FAILED_OUTCOMES) < set(metric_names.MIGRATION_OUTCOMES)
    assert "done" in metric_names.MIGRATION_OUTCOMES
