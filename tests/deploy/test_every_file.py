"""Every file in deploy/ is exercised by a test: each test module lists the files it
checks (COVERS), and together they cover the folder (deploy/nats/ is tested by its own
suite). A new file in deploy/ fails here until some test checks it."""

from __future__ import annotations

from tests.deploy import (
    test_docker,
    test_grafana,
    test_kubernetes,
    test_monitoring_files,
    test_slurm,
    test_systemd,
)
from tests.deploy.files import DEPLOY, deploy_files
from tests.integration import test_alertmanager, test_prometheus

MODULES = [
    test_docker,
    test_grafana,
    test_kubernetes,
    test_monitoring_files,
    test_slurm,
    test_systemd,
    test_alertmanager,
    test_prometheus,
]


def test_every_deploy_file_is_covered() -> None:
    covered = {path for module in MODULES for path in module.COVERS}
    missing = deploy_files() - covered
    assert not missing, f"files in deploy/ no test checks: {sorted(missing)}"
    stale = {p for p in covered if not (DEPLOY / p).is_file()}
    assert not stale, f"COVERS names files that do not exist: {sorted(stale)}"
