"""The rendezvous service: hosts a job's rendezvous store off the training machines.

    trainmover service rendezvous [--store-port 29400] [--http-port 9468]
    python -m trainmover.services.rendezvous ...

Every worker builds its communication groups, and votes on each step's commit, through
one TCPStore (`trainmover.runtime.rendezvous.RendezvousHost`). `trainmover up` hosts it in
its own process; on a cluster this service does, on a machine that is never migrated
away, and every sidecar is started with `--rendezvous HOST:29400` (or
$TRAINMOVER_RENDEZVOUS). It needs no bus: /healthz answers once the store answers a
round trip, and /metrics has the number of keys.

Modules, one job each:
    service  the store and its HTTP endpoints
"""

from __future__ import annotations

import argparse

from trainmover.ports import DEFAULT_HTTP_PORTS, RENDEZVOUS_PORT
from trainmover.service import Service, SettingsError, http_parser, parse, run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("rendezvous", lambda: _load(argv), _build)


def _load(argv: list[str] | None) -> argparse.Namespace:
    p = http_parser("trainmover service rendezvous", DEFAULT_HTTP_PORTS["rendezvous"])
    p.add_argument(
        "--store-host", default="127.0.0.1", help="listen address of the store (0.0.0.0: all)"
    )
    p.add_argument(
        "--store-port", type=int, default=RENDEZVOUS_PORT, help="the store's port (0: a free one)"
    )
    p.add_argument(
        "--store-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a client's store operation may wait (workers pass their own)",
    )
    args = parse(p, argv, needs_bus=False)
    if not 0 <= args.store_port <= 65535:
        raise SettingsError(f"--store-port {args.store_port}: not a port")
    return args


def _build(args: argparse.Namespace) -> Service:
    from trainmover.services.rendezvous.service import RendezvousService

    return RendezvousService(args)


__all__ = ["main"]
