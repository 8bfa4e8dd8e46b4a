"""The planner service: owns the cluster state and turns interruption events into plans.

    trainmover service planner --job-config job.yaml
    python -m trainmover.services.planner --job-config job.yaml

Modules, one job each:
    decisions  the entry point: event/progress/heartbeat + state -> new state and plans (pure)
    drain      planned migrations (drain, straggler, rebalance), and one caught by a recovery
    recovery   failures: replica or checkpoint recovery, superseding, waiting for standbys
    pool       admission of a heartbeat's machine to the standby pool (pure)
    plans      outcomes, joiner choice, and building a plan with its delta (pure)
    cluster    reads and edits of the cluster state shared by the rules (pure)
    service    durable consumers, the state in the key-value bucket, the outbox
"""

from __future__ import annotations

import argparse

from trainmover.ports import DEFAULT_HTTP_PORTS
from trainmover.service import OnBus, base_parser, load_job_config, parse, run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("planner", lambda: _load(argv), _build)


def _load(argv: list[str] | None) -> argparse.Namespace:
    p = base_parser("trainmover service planner", DEFAULT_HTTP_PORTS["planner"])
    p.add_argument(
        "--rebalance-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="move the slowest machine this often (default: never)",
    )
    p.add_argument(
        "--straggler-cooldown",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a machine just moved in is not moved again for a straggler before",
    )
    args = parse(p, argv)
    args.config = load_job_config(args.job_config)
    return args


def _build(args: argparse.Namespace) -> OnBus:
    from trainmover.bus.connection import resolve_auth
    from trainmover.services.planner.decisions import Planner
    from trainmover.services.planner.service import PlannerService

    cluster = args.config.cluster
    members = frozenset([*cluster.machines, *cluster.standbys])
    # Credentials configured: the bus checks them (a component refuses one that does
    # not), so a heartbeat's subject names its sender; otherwise anyone may publish.
    open_bus = not resolve_auth(args.nats_url or "", None).configured
    return OnBus(
        "planner",
        args,
        lambda nc: PlannerService(
            nc,
            args.config,
            Planner(args.straggler_cooldown, members=members),
            args.rebalance_interval,
            open_bus=open_bus,
        ),
    )


__all__ = ["main"]
