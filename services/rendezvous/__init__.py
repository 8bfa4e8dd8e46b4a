"""The rendezvous service: hosts a job's rendezvous store off the training machines.

    trainmover service rendezvous [--store-port 29400] [--http-port 9468]
        [--replicas HOST:PORT,HOST:PORT --replica-index I]
    python -m trainmover.services.rendezvous ...

Every worker builds its communication groups, and votes on each step's commit, through
one TCPStore (`trainmover.runtime.rendezvous.RendezvousHost`). `trainmover up` hosts it in
its own process; on a cluster this service does, on a machine that is never migrated
away, and every sidecar is started with `--rendezvous HOST:29400` (or
$TRAINMOVER_RENDEZVOUS). It needs no bus: /healthz answers once the store answers a
round trip, and /metrics has the number of keys. With `--replicas`, each replica runs
this service and the sidecars name them all (`--rendezvous a:29400,b:29400`): one serves,
the others stand by, and when the serving one is lost a standby takes over within a few
hundred milliseconds while the ranks re-cast their share of the store into it
(`trainmover.runtime.storeclient`).

Modules, one job each:
    service  the store and its HTTP endpoints
"""

from __future__ import annotations

import argparse
import os

from trainmover.ports import DEFAULT_HTTP_PORTS, RENDEZVOUS_PORT, store_addresses
from trainmover.runtime.storegate import SECRET_ENV, read_secret
from trainmover.service import Service, SettingsError, http_parser, parse, run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("rendezvous", lambda: _load(argv), _build)


def _load(argv: list[str] | None) -> argparse.Namespace:
    p = http_parser("trainmover service rendezvous", DEFAULT_HTTP_PORTS["rendezvous"])
    p.add_argument(
        "--store-host", default="127.0.0.1", help="listen address of the store (0.0.0.0: all)"
    )
    p.add_argument(
        "--store-port",
        type=int,
        default=None,
        help=f"the store's port (0: a free one; default: this replica's in --replicas, "
        f"else {RENDEZVOUS_PORT})",
    )
    p.add_argument(
        "--store-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a client's store operation may wait (workers pass their own)",
    )
    p.add_argument(
        "--replicas",
        default="",
        metavar="HOST:PORT,...",
        help="every replica of the job's store, as the sidecars' --rendezvous names them "
        "(this one included); one serves, the others stand by and take over",
    )
    p.add_argument(
        "--replica-index",
        type=int,
        default=0,
        metavar="I",
        help="this replica's place in --replicas (0: the first)",
    )
    p.add_argument(
        "--store-shards",
        type=int,
        default=0,
        metavar="N",
        help="host N more stores for the per-step commit vote, on the N ports after "
        "--store-port (each replica alike); for jobs of many machines (docs/runtime.md)",
    )
    p.add_argument(
        "--store-secret-file",
        default=None,
        metavar="FILE",
        help="the job's store secret (default $TRAINMOVER_STORE_SECRET_FILE): the store "
        "then admits only clients that hold it (`trainmover up --auth` writes one)",
    )
    args = parse(p, argv, needs_bus=False)
    args.store_secret = None
    secret_file = args.store_secret_file or os.environ.get(SECRET_ENV)
    if secret_file:
        try:
            args.store_secret = read_secret(secret_file)
        except (OSError, ValueError) as err:
            raise SettingsError(f"--store-secret-file: {err}") from None
    if args.store_port is not None and not 0 <= args.store_port <= 65535:
        raise SettingsError(f"--store-port {args.store_port}: not a port")
    args.peers = _peers(args)
    if args.store_shards < 0:
        raise SettingsError(f"--store-shards {args.store_shards}: not a number of shards")
    if args.store_shards and args.store_port and args.store_port + args.store_shards > 65535:
        raise SettingsError(
            f"--store-shards {args.store_shards}: the ports after {args.store_port} run out"
        )
    if args.store_shards and args.peers and not args.store_port:
        raise SettingsError("--store-shards with --replicas needs fixed ports (not 0)")
    return args


def _peers(args: argparse.Namespace) -> list[str]:
    """The other replicas, in order; SettingsError naming what does not fit."""
    if not args.replicas:
        if args.replica_index:
            raise SettingsError("--replica-index needs --replicas")
        if args.store_port is None:
            args.store_port = RENDEZVOUS_PORT
        return []
    try:
        listed = store_addresses(args.replicas)
    except ValueError as err:
        raise SettingsError(f"--replicas: {err}") from None
    if not 0 <= args.replica_index < len(listed):
        raise SettingsError(
            f"--replica-index {args.replica_index}: --replicas names {len(listed)} replicas"
        )
    own = listed[args.replica_index][1]
    if args.store_port not in (None, own):
        raise SettingsError(
            f"--replicas names port {own} for replica {args.replica_index}, "
            f"but --store-port is {args.store_port}"
        )
    args.store_port = own
    return [f"{h}:{p}" for i, (h, p) in enumerate(listed) if i != args.replica_index]


def _build(args: argparse.Namespace) -> Service:
    from trainmover.services.rendezvous.service import RendezvousService

    return RendezvousService(args)


__all__ = ["main"]
