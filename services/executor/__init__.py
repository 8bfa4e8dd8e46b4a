"""The executor service: runs each plan as a state machine of commands to the sidecars.

    trainmover service executor --job-config job.yaml
    python -m trainmover.services.executor --job-config job.yaml

Modules, one job each:
    migration  one migration: states, idempotent commands, downtime measurement
    service    plans off the bus, records in the executor's bucket, resume on restart
"""

from __future__ import annotations

import argparse

from trainmover.ports import DEFAULT_HTTP_PORTS
from trainmover.service import OnBus, base_parser, load_job_config, parse, run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("executor", lambda: _load(argv), _build)


def _load(argv: list[str] | None) -> argparse.Namespace:
    p = base_parser("trainmover service executor", DEFAULT_HTTP_PORTS["executor"])
    p.add_argument(
        "--margin", type=int, default=2, help="steps between the furthest rank and the switch step"
    )
    p.add_argument(
        "--command-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long one state of a migration may take",
    )
    p.add_argument(
        "--failure-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long a migration whose worker died waits for the planner to recover "
        "that machine (keeping the joiner it prepared) before it is reported failed",
    )
    args = parse(p, argv)
    args.config = load_job_config(args.job_config)
    return args


def _build(args: argparse.Namespace) -> OnBus:
    from trainmover.services.executor.service import ExecutorService

    return OnBus(
        "executor",
        args,
        lambda nc: ExecutorService(
            nc,
            args.config.job,
            margin=args.margin,
            timeout_s=args.command_timeout,
            failure_grace_s=args.failure_grace,
            groups_total=len(args.config.layout.all_groups()),
        ),
    )


__all__ = ["main"]
