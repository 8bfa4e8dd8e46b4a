"""A sidecar starts and supervises workers; it must not pay for importing torch (several
seconds of CPU per machine on start-up, on the host its workers train on)."""

from __future__ import annotations

import subprocess
import sys


def _imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_the_sidecar_and_the_control_plane_services_do_not_import_torch() -> None:
    for module in (
        "trainmover.services.sidecar.service",
        "trainmover.services.planner.service",
        "trainmover.services.executor.service",
        "trainmover.services.health_monitor.service",
        "trainmover.cli",
    ):
        assert not _imports_torch(module), module


def test_the_worker_side_does() -> None:
    # The check above would pass vacuously if the probe could never see torch.
    assert _imports_torch("trainmover.runtime.rendezvous")
