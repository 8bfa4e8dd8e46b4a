"""One rank of the group-setup scaling benchmark (`trainmover bench scale`).

    python -m trainmover.bench.scale_worker --store HOST:PORT --rank R --layout TPxPPxDP

Round after round, waits for the harness's mode ("delta": rebuild only the groups of the
machine serving cell (dp 0, pp 0) that contain me; "full": all my groups; "end"), builds
those groups at a new generation with the runtime's `build_group`, reports when it was
done, and shuts them down once the harness says every rank is done.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainmover.bench.settings import parse_layout
from trainmover.runtime.groups import build_group
from trainmover.runtime.layout import Layout, MachineRole
from trainmover.runtime.plan import GroupSpec, RankRef, group_specs

LEAVER = MachineRole(dp=0, pp=0)


def my_specs(layout: Layout, me: RankRef, mode: str, generation: int) -> list[GroupSpec]:
    """The groups `me` rebuilds in this round, in the global build order (by name)."""
    assignment = {f"m{i}": cell for i, cell in enumerate(layout.cells())}
    names = None if mode == "full" else layout.groups_containing(layout.roles_of(LEAVER))
    gens = dict.fromkeys(layout.all_groups(), generation)
    specs = group_specs(layout, assignment, gens, names)
    return sorted((s for s in specs if s.group_rank(me) is not None), key=lambda s: s.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--layout", type=parse_layout, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))
    machine, tp = divmod(args.rank, args.layout.tp)
    me = RankRef(machine=f"m{machine}", local_rank=tp)
    store.set(f"hello/{args.rank}", "1")
    for rnd in range(1, 1_000_000):
        mode = store.get(f"round{rnd}/mode").decode()
        if mode == "end":
            return 0
        started = time.time()
        built = [
            build_group(s, me, store, "scale", torch.device("cpu"), 300.0)
            for s in my_specs(args.layout, me, mode, rnd)
        ]
        report = {"t_start": started, "t_end": time.time(), "groups": len(built),
                  "connections": sum(g.size - 1 for g in built)}  # fmt: skip
        store.set(f"round{rnd}/done/{args.rank}", json.dumps(report))
        store.get(f"round{rnd}/close")
        for g in built:
            g.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
