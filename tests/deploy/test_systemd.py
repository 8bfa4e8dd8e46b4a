"""deploy/systemd/: systemd itself accepts the units (systemd-analyze verify), and each
ExecStart is a contract command line whose environment the shipped env file provides."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.files import DEPLOY, check_command
from trainmover import ports

COVERS = [
    "systemd/trainmover-health-monitor.service",
    "systemd/trainmover-planner.service",
    "systemd/trainmover-executor.service",
    "systemd/trainmover-sidecar.service",
    "systemd/trainmover-sidecar-standby.service",
    "systemd/trainmover-rendezvous.service",
    "systemd/trainmover.env",
]

SYSTEMD = DEPLOY / "systemd"
UNITS = sorted(p.name for p in SYSTEMD.glob("*.service"))
EXECUTABLE = "/opt/trainmover/bin/trainmover"
"""Where the units expect `trainmover` (a venv at /opt/trainmover)."""


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string((SYSTEMD / name).read_text())
    return parser


def env_file() -> dict[str, str]:
    out = {}
    for line in (SYSTEMD / "trainmover.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"trainmover.env: not KEY=VALUE: {line!r}"
            out[key] = value
    return out


def test_every_service_has_a_unit() -> None:
    assert UNITS == sorted(
        [f"trainmover-{s}.service" for s in ("health-monitor", "planner", "executor", "rendezvous")]
        + ["trainmover-sidecar.service", "trainmover-sidecar-standby.service"]
    )


@pytest.mark.parametrize("name", UNITS)
def test_exec_start_is_a_contract_command(name: str) -> None:
    u = unit(name)
    service = u["Service"]
    assert service["EnvironmentFile"] == "/etc/trainmover/trainmover.env"
    assert service["Restart"] == "always"
    assert u["Install"]["WantedBy"] == "multi-user.target"
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == EXECUTABLE
    # $VAR words are the env file's (systemd splits them into words).
    env = env_file()
    for word in [a for a in argv if a.startswith("$")]:
        assert word[1:] in env, f"{name}: {word} is not set in trainmover.env"
    command = check_command([a for a in argv if not a.startswith("$")])
    assert (
        name
        == f"trainmover-{command.service}{'-standby' if '--standby' in command.flags else ''}.service"
    )
    if command.service == "rendezvous":
        # Off the bus; reachable from the sidecars' machines on the contract's port.
        assert command.flags["--store-port"] == str(ports.RENDEZVOUS_PORT)
        assert command.flags["--store-host"] == command.flags["--http-host"] == "0.0.0.0"
        return
    assert command.flags["--job-config"] == "/etc/trainmover/job.yaml"
    if command.service == "sidecar":
        assert command.flags["--machine"] == "%l"  # the short hostname
        other = (
            "trainmover-sidecar.service"
            if "--standby" in command.flags
            else "trainmover-sidecar-standby.service"
        )
        assert u["Unit"]["Conflicts"] == other
        assert service["KillMode"] == "mixed"


def test_env_file_sets_what_the_services_read() -> None:
    env = env_file()
    assert env[ports.NATS_URL_ENV].startswith("nats://")
    assert all(f":{ports.NATS_CLIENT_PORT}" in u for u in env[ports.NATS_URL_ENV].split(","))
    assert ports.WEBHOOK_TOKEN_ENV in env
    assert "TRAINMOVER_SIDECAR_FLAGS" in env
    # The sidecars' rendezvous store: the rendezvous unit's port.
    host, _, port = env[ports.RENDEZVOUS_ENV].rpartition(":")
    assert host and port == str(ports.RENDEZVOUS_PORT)


def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    """systemd-analyze verify on the units as shipped, with only the executable's path
    pointed at this checkout's `trainmover` (verify requires it to exist)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze not found: run the install step of .ci/run"
    trainmover = Path(sys.executable).parent / "trainmover"
    assert trainmover.exists(), f"{trainmover}: install the package (make install)"
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        text = text.replace(EXECUTABLE, str(trainmover))
        text = text.replace("/etc/trainmover/trainmover.env", str(SYSTEMD / "trainmover.env"))
        (tmp_path / name).write_text(text)
    run = subprocess.run(
        [analyze, "verify", "--man=no", *(str(tmp_path / n) for n in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # verify exits 0 on unknown keys and bad values too; it only warns: no output = clean.
    assert run.returncode == 0 and not run.stderr.strip() and not run.stdout.strip(), (
        run.stdout + run.stderr
    )
