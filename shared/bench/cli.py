"""``trainmover bench [downtime|rebalance|scale|hangs|state|store|control-plane|all] [options]``: the benchmark commands.

Without a sub-command (``make bench``), runs every benchmark at its default settings and
writes bench-out/<name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from trainmover.bench import (
    control_plane,
    downtime,
    downtime_example,
    hangs,
    rebalance,
    scale,
    state,
    store,
)

#: sub-command -> (add its options, run it)
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {
    "downtime": (downtime.add_arguments, lambda a: (downtime_example if a.example else downtime).main(a)),
    "rebalance": (rebalance.add_arguments, rebalance.main),
    "scale": (scale.add_arguments, scale.main),
    "hangs": (hangs.add_arguments, hangs.main),
    "state": (state.add_arguments, state.main),
    "store": (store.add_arguments, store.main),
    "control-plane": (control_plane.add_arguments, control_plane.main),
}  # fmt: skip
HELP = {
    "downtime": "planned and failure downtime: TrainMover, ablations, torchrun, torchft "
    "(--example NAME: an examples/ script against itself under plain torchrun)",
    "rebalance": "training-time ratio with a migration every P seconds",
    "scale": "delta vs full group setup, measured 4-16 ranks and projected to 65,536",
    "hangs": "a hung machine: detection and downtime by hang kind, against the timeout",
    "state": "downtime, throughput and memory of a migration from 16 MB to 4 GB of state "
    "per rank, against the link and checkpoint-restart",
    "store": "training lost per rendezvous store loss, and the per-step vote's cost at 4-16 "
    "ranks against a bare TCPStore, projected to 1,024",
    "control-plane": "the real services against 64-8,192 simulated machines of 8 GPUs: "
    "detection, planning, commands, cluster state, CPU, memory, bus load",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name, (add, _) in COMMANDS.items():
        add(sub.add_parser(name, help=HELP[name]))
    every = sub.add_parser("all", help="every benchmark at its defaults")
    every.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.bench in COMMANDS:
        return COMMANDS[args.bench][1](args)
    out = getattr(args, "out", Path("bench-out"))
    for name in COMMANDS:
        code = main([name, "--json", str(out / f"{name}.json")])
        if code:
            return code
    return 0
