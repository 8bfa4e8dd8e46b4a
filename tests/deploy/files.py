"""Reading deploy/ for the tests, and checking a service command line against the contract.

The contract is trainmover.ports (ports, flags, image) and the health-monitor's real
argument parser; every manifest, unit and script in deploy/ that starts a service goes
through `check_command`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainmover import ports
from trainmover.service import http_parser
from trainmover.services.health_monitor import config as hm_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"

LOOPBACK = http_parser("any", 0).parse_args([]).http_host
"""`--http-host` of the services built on trainmover.service.http_parser, when not given."""

OWNED_ELSEWHERE = ("nats",)
"""deploy/ folders other work owns and tests (deploy/nats/: the NATS cluster config)."""


def deploy_files() -> set[str]:
    """Every file under deploy/ (relative paths), but the folders owned elsewhere."""
    found = set()
    for path in DEPLOY.rglob("*"):
        rel = path.relative_to(DEPLOY)
        if (
            path.is_file()
            and rel.parts[0] not in OWNED_ELSEWHERE
            and "__pycache__" not in rel.parts
        ):
            found.add(rel.as_posix())
    return found


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_docs(path: Path) -> list[dict[str, Any]]:
    """The documents of a multi-document YAML file (empty ones dropped)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> list[dict[str, Any]]:
    """Every Kubernetes object of deploy/kubernetes/ (the kustomization excluded)."""
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += load_docs(path)
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in manifests() if d["kind"] == kind]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ServiceCommand:
    """A checked `trainmover service NAME ...` command line."""

    service: str
    flags: dict[str, str | None]
    """Flag -> value (None for a switch)."""

    @property
    def http_port(self) -> int:
        return int(self.flags["--http-port"] or 0)


def _parse_flags(service: str, argv: list[str]) -> dict[str, str | None]:
    allowed = ports.SERVICE_FLAGS[service]
    flags: dict[str, str | None] = {}
    it: Iterator[str] = iter(argv)
    for token in it:
        assert token.startswith("--"), f"{service}: unexpected argument {token!r} in {argv}"
        name, eq, inline = token.partition("=")
        assert name in allowed, (
            f"{service}: flag {name} is not in the service contract (trainmover.ports): "
            f"{sorted(allowed)}"
        )
        if name in ports.SWITCHES:
            assert not eq, f"{service}: {name} takes no value"
            flags[name] = None
        else:
            value = inline if eq else next(it, None)
            assert value is not None, f"{service}: {name} needs a value"
            flags[name] = value
    return flags


def check_command(argv: list[str]) -> ServiceCommand:
    """Checks `[trainmover] service NAME flags...` against the contract and returns it.

    Flags must be in trainmover.ports.SERVICE_FLAGS, --http-port must be the service's
    default port (so probes, Services and scrape configs agree without per-site edits),
    and the health-monitor's flags must parse with its real argument parser.
    """
    start = argv.index("service")
    assert all(a.endswith("trainmover") for a in argv[:start]), f"not a trainmover command: {argv}"
    service, rest = argv[start + 1], argv[start + 2 :]
    assert service in ports.SERVICES, f"unknown service {service!r}"
    flags = _parse_flags(service, rest)
    assert flags.get("--http-port") == str(ports.DEFAULT_HTTP_PORTS[service]), (
        f"{service}: --http-port {flags.get('--http-port')} is not its port "
        f"{ports.DEFAULT_HTTP_PORTS[service]} (trainmover.ports.DEFAULT_HTTP_PORTS)"
    )
    # Probes, Prometheus and Alertmanager come from other hosts (or the pod's address):
    # a service listening on its loopback default would look dead to all of them.
    default_host = hm_config.Settings().http_host if service == "health-monitor" else LOOPBACK
    assert flags.get("--http-host", default_host) == "0.0.0.0", (
        f"{service}: /healthz and /metrics would listen on "
        f"{flags.get('--http-host', default_host)} only; pass --http-host 0.0.0.0"
    )
    if service == "health-monitor":
        parse_health_monitor_flags(rest)
    return ServiceCommand(service, flags)


def parse_health_monitor_flags(argv: list[str]) -> argparse.Namespace:
    """The health-monitor's own parser on `argv`; an error fails with its message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return hm_config.parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(
                f"health-monitor rejects {argv}: {err.getvalue().strip()}"
            ) from None
