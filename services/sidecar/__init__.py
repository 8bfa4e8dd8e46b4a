"""The sidecar service: one per machine, supervises its worker processes.

    trainmover service sidecar --job-config job.yaml --machine m0 --rendezvous HOST:PORT
    python -m trainmover.services.sidecar ...

Modules, one job each:
    workers  the machine's worker processes and the control channel to them
    service  commands from the executor, heartbeats, step statistics, maintenance
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from trainmover.ports import DEFAULT_HTTP_PORTS, RENDEZVOUS_ENV, store_addresses
from trainmover.service import (
    Service,
    SettingsError,
    base_parser,
    load_job_config,
    parse,
    run_service,
)
from trainmover.subjects import InvalidName, check_name


def main(argv: list[str] | None = None) -> int:
    return run_service("sidecar", lambda: _load(argv), _build)


def _load(argv: list[str] | None) -> argparse.Namespace:
    p = base_parser("trainmover service sidecar", DEFAULT_HTTP_PORTS["sidecar"])
    p.add_argument("--machine", required=True, help="this machine's name")
    p.add_argument(
        "--rendezvous",
        default=os.environ.get(RENDEZVOUS_ENV),
        help="HOST:PORT of the rendezvous store, or of each of its replicas, comma-separated "
        "(default $TRAINMOVER_RENDEZVOUS)",
    )
    p.add_argument("--run-dir", type=Path, help="worker logs and state (default: temporary)")
    p.add_argument(
        "--entry",
        default="trainmover.runtime.reference",
        help="the worker module each local rank runs (python -m ENTRY)",
    )
    p.add_argument("--heartbeat-interval", type=float, default=0.5, metavar="SECONDS")
    p.add_argument(
        "--standby",
        action="store_true",
        help="this machine is a standby (refused if the job lists it as active)",
    )
    args = parse(p, argv)
    try:
        check_name("machine", args.machine)
    except InvalidName as err:
        raise SettingsError(str(err)) from None
    if not args.rendezvous:
        raise SettingsError(
            f"no rendezvous store: pass --rendezvous HOST:PORT or set {RENDEZVOUS_ENV}"
        )
    try:
        store_addresses(args.rendezvous)
    except ValueError as err:
        raise SettingsError(f"--rendezvous: {err}") from None
    args.config = load_job_config(args.job_config)
    if args.standby and args.machine in args.config.cluster.machines:
        raise SettingsError(f"--standby, but the job config lists {args.machine} as active")
    return args


def _build(args: argparse.Namespace) -> Service:
    from trainmover.services.sidecar.service import Sidecar, SidecarSettings

    return Sidecar(
        SidecarSettings(
            nats_url=args.nats_url,
            config=args.config,
            machine=args.machine,
            rendezvous=args.rendezvous,
            run_dir=args.run_dir,
            entry=args.entry,
            heartbeat_interval_s=args.heartbeat_interval,
            http_host=args.http_host,
            http_port=args.http_port,
            port_file=args.port_file,
            log_format=args.log_format,
            log_level=args.log_level,
        )
    )


__all__ = ["main"]
