"""A role's c10d groups in one process, over sandboxed runtime groups (no peers needed):
what is handed out, and what is refused, with the call and the fix in the message."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainmover.runtime import pgs as P
from trainmover.runtime.c10d import GroupNotReady, SwappableGroup, UnsupportedCollective
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Layout, Role
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.sandbox import SandboxGroup, SandboxStats
from trainmover.runtime.standard import StandardTorch

LAYOUT = Layout(tp=2, pp=1, dp=2)
ROLE = Role(dp=1, pp=0, tp=1)


def sandboxed(layout: Layout, role: Role, stats: SandboxStats) -> GroupTable:
    table = GroupTable()
    for kind in (*layout.role_group_kinds, "world"):
        rank, size = layout.rank_and_size(kind, role)  # type: ignore[arg-type]
        spec = GroupSpec(
            name=f"x.{kind}",
            kind=kind,  # type: ignore[arg-type]
            generation=0,
            members=[RankRef(machine="sandbox", local_rank=i) for i in range(size)],
        )
        table.install([SandboxGroup(spec, rank, {}, stats, seed=1)])
    return table


@pytest.fixture
def groups():
    stats = SandboxStats()
    table = sandboxed(LAYOUT, ROLE, stats)
    pgs = P.ProcessGroups(LAYOUT, ROLE, table.get, dist.HashStore(), prefix="t.")
    yield pgs, stats
    pgs.close()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_each_kind_is_one_stable_group_with_the_roles_rank_and_size(groups):
    pgs, _ = groups
    dp = pgs.get("dp")
    assert pgs.get("dp") is dp
    assert (dp.rank(), dp.size()) == (1, 2) and (pgs.get("tp").rank(), pgs.get("tp").size()) == (
        1,
        2,
    )
    # Registered by name with the global ranks of its members
    assert dist.distributed_c10d._resolve_process_group(dp.group_name) is dp
    assert dist.get_global_rank(dp, 1) == LAYOUT.global_rank(ROLE)


def test_ddp_over_the_dp_group_is_accepted_and_its_collectives_answered(groups):
    pgs, stats = groups
    ddp = DDP(model(), process_group=pgs.get("dp"))
    assert P.check_ddp(ddp, pgs) == "dp"
    ddp(torch.ones(3, 4)).sum().backward()
    assert stats.synthesized >= 2  # start-up checks and the gradient all-reduce


def test_ddp_over_another_groups_shape_is_refused_with_both_shapes(groups):
    pgs, _ = groups
    ddp = DDP(model(), process_group=pgs.get("tp"))
    with pytest.raises(P.LayoutMismatch, match=r"tp group \(2 ranks\).*dp=2"):
        P.check_ddp(ddp, pgs)


def test_ddp_over_a_group_the_runtime_did_not_hand_out_is_refused(groups):
    pgs, _ = groups
    stats = SandboxStats()
    foreign_table = sandboxed(LAYOUT, ROLE, stats)
    foreign = SwappableGroup("foreign", 1, 2, lambda: foreign_table["dp"])
    ddp = DDP(model(), process_group=foreign)
    with pytest.raises(UnsupportedCollective, match="rt.process_group"):
        P.check_ddp(ddp, pgs)


def test_the_world_group_of_a_multi_dimensional_layout_forwards_to_the_world_kind(groups):
    pgs, stats = groups
    world = pgs.world()
    assert (world.rank(), world.size()) == (LAYOUT.global_rank(ROLE), 4)
    assert world is not pgs.get("dp") and world is not pgs.get("tp")
    t = torch.ones(2)
    dist.all_reduce(t, group=world)  # answered by the sandbox: as if all 4 held ours
    assert torch.equal(t, torch.full((2,), 4.0)) and stats.synthesized == 1


def test_a_collective_before_the_group_is_installed_names_the_fix():
    pg = SwappableGroup("early", 0, 2, lambda: None)
    with pytest.raises(GroupNotReady, match="allreduce on process group 'early'.*rt.steps"):
        pg.allreduce([torch.ones(1)])


def test_torchrun_environment_follows_the_role(monkeypatch):
    for name in P.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    layout = Layout(tp=2, pp=2, dp=2)
    P.set_torchrun_env(layout, Role(dp=1, pp=1, tp=1), layout.tp, "127.0.0.1:29400")
    got = {name: os.environ[name] for name in P.TORCHRUN_ENV}
    assert got == {
        "RANK": "7",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
    }


HSDP = Layout(tp=2, pp=1, dp=4, dp_shard=2)
HSDP_ROLE = Role(dp=3, pp=0, tp=1)


@pytest.fixture
def hsdp():
    pgs = P.ProcessGroups(
        HSDP, HSDP_ROLE, sandboxed(HSDP, HSDP_ROLE, SandboxStats()).get, dist.HashStore(), "h."
    )
    P.install_hooks()
    with P.activated(pgs, default=True):
        yield pgs
    P.remove_hooks()
    pgs.close()


def test_the_device_mesh_runs_each_dimension_over_the_roles_group(hsdp):
    mesh = hsdp.device_mesh("cpu")
    assert hsdp.device_mesh("cpu") is mesh
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    for dim, (size, kind) in HSDP.mesh_dims().items():
        assert mesh[dim].get_group() is hsdp.get(kind)
        assert mesh[dim].size() == size
        assert mesh.get_local_rank(dim) == HSDP.mesh_coordinate(HSDP_ROLE, dim)
    assert mesh.get_rank() == HSDP.global_rank(HSDP_ROLE)


def test_a_mesh_the_script_builds_itself_is_refused_naming_the_runtimes(hsdp):
    with pytest.raises(UnsupportedCollective, match=r"rt.device_mesh\(\)"):
        torch.distributed.device_mesh.init_device_mesh(
            "cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c")
        )


def test_a_dp_group_is_refused_where_the_dp_ranks_shard_and_replicate(hsdp):
    with pytest.raises(ValueError, match="no process group of kind 'dp' in layout 2x1x4s2"):
        hsdp.get("dp")


def test_a_live_hsdp_ranks_world_collectives_go_to_the_world_group(monkeypatch):
    """A TP x HSDP role has no "dp" group: once its groups are installed, its default
    group forwards to the real world group, never to the joiner's sandboxed stand-in."""
    for name in P.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    stats = SandboxStats()
    table = sandboxed(HSDP, HSDP_ROLE, stats)  # stands for the live groups here

    class World:
        def current(self) -> object:
            return table["world"]

        def close(self) -> None:
            return None

    live = StandardTorch(HSDP, table, lambda: None)
    live.new_world = lambda role: World()  # type: ignore[assignment,return-value]
    try:
        live.take_role(HSDP_ROLE, "127.0.0.1:29400")
        assert live.live is not None
        dist.all_reduce(torch.ones(2), group=live.live.world())
        assert stats.synthesized == 1  # answered by the world group, not a stand-in
    finally:
        live.close()
        if live.live is not None:
            live.live.close()
