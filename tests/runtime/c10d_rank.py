"""One rank of `test_c10d.py`: `python -m tests.runtime.c10d_rank RANK SIZE PORT OUT`.

Trains two identical DDP models over the runtime's c10d groups of a DP-only layout; the
first one's DP group gets a new-generation inner group (new store prefix, same members)
after step 3 and its reducer is realigned, the second one's never. Writes what the test
checks to OUT (a torch file): both models' final parameters, what functional collectives
and dist.* wrappers returned before and after the swap, and the errors of refused calls.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.parallel import DistributedDataParallel as DDP

from trainmover.runtime import pgs as P
from trainmover.runtime.abort import AbortSignal, StepAborted
from trainmover.runtime.build import build_group
from trainmover.runtime.c10d import SwappableGroup, register, unregister
from trainmover.runtime.groups import Group, GroupTable
from trainmover.runtime.layout import Layout, Role
from trainmover.runtime.plan import GroupSpec, RankRef

STEPS, SWAP_AFTER = 6, 3
CPU = torch.device("cpu")
#: The waits `abort_a_wait` aborts (test_c10d.py parametrises over them).
ABORTED = ("all_reduce", "reduce_scatter", "ddp_backward")


def spec(name: str, kind: str, generation: int, ranks: list[int]) -> GroupSpec:
    members = [RankRef(machine=f"m{i}", local_rank=0) for i in ranks]
    return GroupSpec(name=name, kind=kind, generation=generation, members=members)  # type: ignore[arg-type]


def table(store: dist.Store, rank: int, size: int, name: str) -> GroupTable:
    me = RankRef(machine=f"m{rank}", local_rank=0)
    t = GroupTable()
    t.install(
        [
            build_group(
                spec(f"{name}.{kind}.{rank if kind != 'dp' else ''}", kind, 0, members),
                me,
                store,
                "j",
                CPU,
                30,
            )
            for kind, members in (("dp", list(range(size))), ("tp", [rank]), ("pp", [rank]))
        ]
    )
    return t


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train_step(model: DDP, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(step * 100 + rank)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=gen)).square().mean().backward()
    opt.step()


def point_to_point(pg: dist.ProcessGroup, group: Group, rank: int) -> dict[str, object]:
    """Rank 0 sends, rank 1 receives (tagged), over the c10d group; rank 1's recording
    tap sees what it received."""
    tapped: list[tuple[int, torch.Tensor]] = []
    group.tap = lambda tag, t: tapped.append((tag, t.clone()))
    if rank == 0:
        dist.isend(torch.arange(4.0), group_dst=1, group=pg, tag=7).wait()
        dist.send(torch.full((2,), 9.0), group_dst=1, group=pg, tag=8)
        got = torch.zeros(1)
    else:
        got = torch.zeros(4)
        dist.recv(got, group_src=0, group=pg, tag=7)
        last = torch.zeros(2)
        dist.irecv(last, group_src=0, group=pg, tag=8).wait()
    group.tap = None
    return {"got": got, "tapped": tapped}


def abort_a_wait(store: dist.Store, rank: int, collective: str) -> dict[str, object]:
    """Rank 0 posts `collective` ("all_reduce"; "reduce_scatter": gloo gives its work
    no future, and its timed wait blocks for the group's whole timeout; "ddp_backward":
    DDP's reducer waits on its bucket's future in C++) over a group whose other member
    never does (and stays alive); its abort signal, set from another thread, ends the
    wait."""
    me = RankRef(machine=f"m{rank}", local_rank=0)
    signal = AbortSignal("e0", 60)
    name = f"abort.{collective}"
    group = build_group(spec(name, "dp", 0, [0, 1]), me, store, "j", CPU, 60, signal)
    pg = SwappableGroup(name, rank, 2, lambda: group)
    register(pg, [0, 1], store)
    ddp = DDP(make_model(), process_group=pg) if collective == "ddp_backward" else None

    def post(backend: bool) -> None:
        if ddp is not None:
            if backend:  # the one bucket of the model's gradients, as DDP reduces it
                size = sum(p.numel() for p in ddp.parameters())
                group.backend.allreduce([torch.zeros(size)]).wait()
            else:
                ddp(torch.ones(4, 8)).square().mean().backward()
        elif collective == "all_reduce":
            if backend:
                group.backend.allreduce([torch.ones(2)]).wait()
            else:
                dist.all_reduce(torch.ones(2), group=pg)
        elif backend:
            opts = dist.ReduceScatterOptions()
            group.backend._reduce_scatter_base(torch.ones(1), torch.ones(2), opts).wait()
        else:
            dist.reduce_scatter_single(torch.ones(1), torch.ones(2), group=pg)

    outcome: dict[str, object] = {}
    if rank == 0:
        threading.Timer(0.3, signal.set, ("e0", "a peer is gone")).start()
        try:
            post(backend=False)
        except (StepAborted, RuntimeError) as exc:  # DDP's reducer raises its own
            outcome = {"error": str(exc)}
        outcome["dirty"] = group.dirty
        store.set(f"{name}/done", "1")
        store.wait([f"{name}/matched"])  # the abandoned work is over on the wire too
    else:
        store.wait([f"{name}/done"])
        post(backend=True)
        store.set(f"{name}/matched", "1")
    unregister(pg)
    group.shutdown()
    return outcome


def waited_works_are_forgotten(pg: dist.ProcessGroup, group: Group) -> dict[str, object]:
    """Collectives of every kind FSDP2 and DTensor post, each waited: the group stays
    clean and keeps no record of them (gloo never marks a reduce-scatter completed, even
    after its wait). With whether the reduce-scatter's sums are right."""
    out, size = torch.empty(2), pg.size()
    for _ in range(20):
        dist.reduce_scatter_tensor(out, torch.ones(2 * size), group=pg)
        dist.all_gather_into_tensor(torch.empty(2 * size), torch.ones(2), group=pg)
        funcol.reduce_scatter_tensor(torch.ones(2 * size), "sum", 0, pg).wait()
        funcol.all_reduce(torch.ones(2), "sum", pg).wait()
    return {"dirty": group.dirty, "kept": len(group._c10d), "sum": out.tolist()}


def main(rank: int, size: int, port: int, out: str) -> int:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    layout = Layout(tp=1, pp=1, dp=size)
    role = Role(dp=rank, pp=0, tp=0)
    swapped, steady = table(store, rank, size, "a"), table(store, rank, size, "b")
    pgs_a = P.ProcessGroups(layout, role, swapped.get, store, prefix="a.")
    pgs_b = P.ProcessGroups(layout, role, steady.get, store, prefix="b.")
    P.install_hooks()
    result: dict[str, object] = {}
    with P.activated(pgs_a, default=False):
        dist.init_process_group("gloo")  # a torchrun script's own call
        result["default_is_dp"] = dist.group.WORLD is pgs_a.get("dp")
        result["rank"], result["world"] = dist.get_rank(), dist.get_world_size()
        try:
            dist.init_process_group("gloo", world_size=size + 1)
        except P.LayoutMismatch as exc:
            result["mismatch"] = str(exc)
        try:
            dist.new_group([0])
        except Exception as exc:
            result["new_group"] = f"{type(exc).__name__}: {exc}"
        try:
            dist.recv(torch.zeros(1), group=pgs_a.get("dp"))  # no source: recv_anysource
        except Exception as exc:
            result["anysource"] = f"{type(exc).__name__}: {exc}"
    a = DDP(make_model(), process_group=pgs_a.get("dp"))
    b = DDP(make_model(), process_group=pgs_b.get("dp"))
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.01)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.01)
    name = pgs_a.get("dp").group_name
    for step in range(1, STEPS + 1):
        train_step(a, opt_a, step, rank)
        train_step(b, opt_b, step, rank)
        if step == SWAP_AFTER:
            result["funcol_before"] = funcol.all_reduce(
                torch.full((2,), rank + 1.0), "sum", name
            ).wait()
            old = swapped["dp"]
            me = RankRef(machine=f"m{rank}", local_rank=0)
            new = build_group(
                spec("a.dp.", "dp", 1, list(range(size))), me, store, "j", torch.device("cpu"), 30
            )
            assert swapped.install([new]) == [old]
            old.shutdown()
            P.realign(a)
            result["same_object"] = a.process_group is pgs_a.get("dp")
            result["funcol_after"] = funcol.all_reduce(
                torch.full((2,), rank + 1.0), "sum", name
            ).wait()
            t = torch.full((3,), float(rank))
            dist.broadcast(t, group_src=1, group=pgs_a.get("dp"))
            result["broadcast_after"] = t
            result["p2p"] = point_to_point(pgs_a.get("dp"), swapped["dp"], rank)
    result["bookkeeping"] = waited_works_are_forgotten(pgs_b.get("dp"), steady["dp"])
    result["a"] = {n: p.detach().clone() for n, p in a.module.named_parameters()}
    result["b"] = {n: p.detach().clone() for n, p in b.module.named_parameters()}
    result["aborted"] = {c: abort_a_wait(store, rank, c) for c in ABORTED}
    torch.save(result, out)
    for t in (swapped, steady):
        t.shutdown()
    P.remove_hooks()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
