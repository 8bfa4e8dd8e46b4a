"""One rank of the group-setup scaling benchmark (`trainmover bench scale`).

    python -m trainmover.bench.scale_worker --store HOST:PORT --rank R --layout TPxPPxDP

Task after task (`task/<rank>/<i>`, set by the harness only for the ranks that take
part in a round, so the others sleep in the store and cost nothing), builds the groups
of the round's mode at a new generation with the runtime's `build_group` ("delta": only
the groups of the machine serving cell (dp 0, pp 0) that contain me; "fixed": those of
them that are not DP groups; "full": all my groups; "end": exit), reports when it was done, and shuts them down once the harness
says every rank is done, reporting that too: the next round starts only after every
teardown, so no round pays for the previous one's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainmover.bench.settings import parse_layout
from trainmover.runtime.build import build_group
from trainmover.runtime.layout import Layout, MachineRole
from trainmover.runtime.plan import GroupSpec, RankRef, group_specs

LEAVER = MachineRole(dp=0, pp=0)


def rank_ref(layout: Layout, rank: int) -> RankRef:
    """Rank `rank` of the world: machine m<rank // TP>, local rank = its TP rank."""
    machine, tp = divmod(rank, layout.tp)
    return RankRef(machine=f"m{machine}", local_rank=tp)


#: Round modes: the leaver's delta; its groups whose size does not depend on DP (its
#: TP group and PP groups: the same groups in every TP2 x PP2 x DPn world); every group.
MODES = ("delta", "fixed", "full")


def mode_groups(layout: Layout, mode: str) -> list[str] | None:
    """Names of the groups a round of `mode` rebuilds (None: all)."""
    if mode == "full":
        return None
    delta = layout.groups_containing(layout.roles_of(LEAVER))
    if mode == "fixed":
        kinds = layout.all_groups()
        return [n for n in delta if kinds[n][0] != "dp"]
    return delta


def my_specs(layout: Layout, me: RankRef, mode: str, generation: int) -> list[GroupSpec]:
    """The groups `me` rebuilds in this round, in the global build order (by name)."""
    assignment = {f"m{i}": cell for i, cell in enumerate(layout.cells())}
    names = mode_groups(layout, mode)
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
    me = rank_ref(args.layout, args.rank)
    store.set(f"hello/{args.rank}", "1")
    for i in itertools.count(1):
        task = json.loads(store.get(f"task/{args.rank}/{i}"))
        if task["mode"] == "end":
            return 0
        rnd = task["round"]
        started = time.time()
        built, ends = [], []
        for spec in my_specs(args.layout, me, task["mode"], rnd):
            built.append(build_group(spec, me, store, "scale", torch.device("cpu"), 300.0))
            ends.append(time.time())
        report = {"t_start": started, "t_end": time.time(), "groups": len(built),
                  "connections": sum(g.size - 1 for g in built),
                  # Per group: (name, size, when it was built, its own constructor time).
                  "built": [(g.name, g.size, t, g.build_s) for g, t in zip(built, ends, strict=True)]}  # fmt: skip
        store.set(f"round{rnd}/done/{args.rank}", json.dumps(report))
        store.get(f"round{rnd}/close")
        for g in built:
            g.shutdown()
        # Dropping a gloo group joins its threads (~10 ms each here): done now, before
        # the round counts as closed, and not inside the next round's measurement.
        built.clear()
        store.set(f"round{rnd}/closed/{args.rank}", "1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
