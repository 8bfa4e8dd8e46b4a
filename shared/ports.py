"""The deployment contract of the services: HTTP ports, command-line flags, image.

Every service is started as `trainmover service NAME [flags]` (or `python -m
trainmover.services.NAME [flags]`) and serves `/healthz` and `/metrics` (the
health-monitor also `POST /webhook`) on one HTTP port; the rendezvous service also
serves the job's rendezvous store (a TCPStore) on RENDEZVOUS_PORT. The manifests, scripts and units
in deploy/ are written against this module, and tests/deploy checks them against it;
each service's argument parser must accept the flags listed here.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from trainmover import __version__

SERVICES: Final = ("health-monitor", "planner", "executor", "sidecar", "rendezvous")

DEFAULT_HTTP_PORTS: Final = MappingProxyType(
    {"health-monitor": 9464, "planner": 9465, "executor": 9466, "sidecar": 9467, "rendezvous": 9468}
)
"""Default `--http-port` of each service: /healthz, /metrics (and /webhook)."""

RENDEZVOUS_PORT: Final = 29400
"""The rendezvous store's port (`--store-port`), as the sidecars' `--rendezvous` names it."""

RENDEZVOUS_ENV: Final = "TRAINMOVER_RENDEZVOUS"
"""HOST:PORT of the rendezvous store, when a sidecar gets no --rendezvous."""

NATS_CLIENT_PORT: Final = 4222
"""nats-server's client port, as the manifests and units address it."""

HEALTH_PATH: Final = "/healthz"
METRICS_PATH: Final = "/metrics"
WEBHOOK_PATH: Final = "/webhook"
"""The health-monitor's Alertmanager webhook."""

HTTP_FLAGS: Final = frozenset(
    {
        "--http-host",  # listen address of the HTTP port (0.0.0.0)
        "--http-port",  # the HTTP port (DEFAULT_HTTP_PORTS; 0 picks a free one)
        "--port-file",  # write the bound HTTP port here (for --http-port 0)
        "--log-format",  # json | console
        "--log-level",
    }
)
"""Flags every service accepts (the rendezvous service needs no more)."""

COMMON_FLAGS: Final = HTTP_FLAGS | {
    "--nats-url",  # NATS server(s); default $TRAINMOVER_NATS_URL
    "--job-config",  # the job config file (layout; a section per service)
}
"""Flags every service on the bus accepts."""

SERVICE_FLAGS: Final = MappingProxyType(
    {
        "health-monitor": COMMON_FLAGS | {"--job", "--rules", "--config", "--webhook-token-file"},
        "planner": COMMON_FLAGS,
        "executor": COMMON_FLAGS,
        "sidecar": COMMON_FLAGS
        | {
            "--machine",  # this machine's name in the job (the node's or pod's name)
            "--standby",  # join the standby pool (warm, not training) instead of a role
            "--rendezvous",  # HOST:PORT[,HOST:PORT...] of the store's replicas
        },
        "rendezvous": HTTP_FLAGS
        | {
            "--store-host",  # listen address of the store (0.0.0.0)
            "--store-port",  # RENDEZVOUS_PORT
            "--replicas",  # every replica of the store, as the sidecars name them
            "--replica-index",  # this replica's place among them
            "--store-shards",  # stores of the commit vote on the ports after --store-port
            "--store-secret-file",  # the job's store secret: admit only clients holding it
        },
    }
)
"""The flags deploy/ may pass to each service; nothing else."""

SWITCHES: Final = frozenset({"--standby"})
"""Flags of SERVICE_FLAGS that take no value."""

NATS_URL_ENV: Final = "TRAINMOVER_NATS_URL"
WEBHOOK_TOKEN_ENV: Final = "TRAINMOVER_WEBHOOK_TOKEN"

IMAGE_REPOSITORY: Final = "ghcr.io/trainmover/trainmover"
IMAGE: Final = f"{IMAGE_REPOSITORY}:{__version__}"
"""The container image of this release (built from deploy/docker/Dockerfile)."""


def store_addresses(address: str) -> list[tuple[str, int]]:
    """(host, port) of each replica of `address` ("host:port[,host:port...]")."""
    out: list[tuple[str, int]] = []
    for part in address.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"rendezvous store {part!r} in {address!r}: not HOST:PORT")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no rendezvous store address")
    return out
