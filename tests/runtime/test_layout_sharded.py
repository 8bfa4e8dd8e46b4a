"""Sharded data parallelism in the layout (FSDP2, HSDP): groups, mesh, replicas. Pure."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainmover.messages import ClusterState, FailureEvent, MachineState
from trainmover.runtime.layout import Layout, MachineRole, Role
from trainmover.runtime.plan import compute_delta
from trainmover.services.planner.decisions import Outcome, Planner

HSDP = Layout(tp=2, pp=1, dp=4, dp_shard=2)


def test_hsdp_roles_have_a_shard_and_a_replicate_group_instead_of_dp() -> None:
    role = Role(dp=3, pp=0, tp=1)  # shard 1 of replica 1
    assert HSDP.hsdp and HSDP.dp_replicate == 2
    assert HSDP.role_group_kinds == ("tp", "pp", "dp_shard", "dp_replicate")
    assert HSDP.group_members("dp_shard", role) == [Role(dp=2, pp=0, tp=1), role]
    assert HSDP.group_members("dp_replicate", role) == [Role(dp=1, pp=0, tp=1), role]
    kinds = {kind for kind, _ in HSDP.all_groups().values()}
    assert kinds == {"tp", "pp", "dp_shard", "dp_replicate"}
    # Every role is in exactly one group of each kind.
    for cell in HSDP.cells():
        for r in HSDP.roles_of(cell):
            names = [n for n, (_, members) in HSDP.all_groups().items() if r in members]
            assert len(names) == 4


@pytest.mark.parametrize("dp_shard", [1, 4])
def test_pure_fsdp_and_pure_replication_keep_one_dp_group(dp_shard: int) -> None:
    layout = Layout(tp=1, pp=2, dp=4, dp_shard=dp_shard)
    assert not layout.hsdp and layout.role_group_kinds == ("tp", "pp", "dp")
    dims = layout.mesh_dims()
    dp_dim = "dp_shard" if dp_shard > 1 else "dp_replicate"
    assert dims == {"pp": (2, "pp"), dp_dim: (4, "dp")}


def test_mesh_dims_in_torchtitan_order_leave_out_size_one() -> None:
    layout = Layout(tp=2, pp=2, dp=4, dp_shard=2)
    assert list(layout.mesh_dims()) == ["pp", "dp_replicate", "dp_shard", "tp"]
    assert list(Layout(tp=2, pp=1, dp=1).mesh_dims()) == ["tp"]
    role = Role(dp=3, pp=1, tp=0)
    coords = {d: layout.mesh_coordinate(role, d) for d in layout.mesh_dims()}
    assert coords == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 0}


def test_only_ranks_of_the_same_shard_hold_the_same_state() -> None:
    cell = MachineRole(dp=1, pp=0)
    same = [d for d in range(4) if HSDP.holds_same_state(cell, MachineRole(dp=d, pp=0))]
    assert same == [3]
    fsdp = Layout(dp=2, dp_shard=2)
    assert not fsdp.holds_same_state(MachineRole(dp=0, pp=0), MachineRole(dp=1, pp=0))
    ddp = Layout(dp=2)
    assert ddp.holds_same_state(MachineRole(dp=0, pp=0), MachineRole(dp=1, pp=0))


def test_the_label_round_trips_and_a_shard_that_does_not_divide_is_refused() -> None:
    assert Layout.parse("2x1x4s2") == HSDP and HSDP.label == "2x1x4s2"
    assert Layout.parse("2x2x2").label == "2x2x2"
    with pytest.raises(ValueError, match="S divides DP"):
        Layout.parse("1x1x4s3")
    with pytest.raises(ValidationError, match="does not divide"):
        Layout(dp=4, dp_shard=3)


def _state(layout: Layout) -> ClusterState:
    machines = {
        f"m{i}": MachineState(status="active", cell=c) for i, c in enumerate(layout.cells())
    }
    machines["s0"] = MachineState(status="standby", warm_role_types=layout.role_types())
    return ClusterState(job="j", layout=layout, machines=machines)


def _m1_fails(layout: Layout) -> Outcome:
    """The planner's answer to m1's failure in a job of `layout` with one warm standby."""
    failure = FailureEvent(job="j", machine="m1", source="heartbeat")
    return Planner(straggler_cooldown_s=60).on_event(_state(layout), failure, 0.0)


def test_a_failed_shard_recovers_from_the_replica_of_its_own_shard() -> None:
    out = _m1_fails(Layout(dp=4, dp_shard=2))
    (plan,) = out.plans
    assert plan.restore == "transfer" and plan.state_sources == {"m1": "m3"}


def test_pure_fsdp_has_no_replica_and_falls_back_to_the_checkpoint() -> None:
    out = _m1_fails(Layout(dp=2, dp_shard=2))
    (plan,) = out.plans
    assert plan.restore == "checkpoint" and plan.migration == "checkpoint_restart"
    (fallback,) = [p for p in out.progress if p.state == "fallback"]
    assert "no data-parallel replica of the roles of m1" in fallback.detail
    assert "pure FSDP: DP=2 shards one copy" in fallback.detail


def test_a_plan_refuses_a_source_of_another_shard() -> None:
    layout = Layout(dp=4, dp_shard=2)
    assignment = {f"m{i}": c for i, c in enumerate(layout.cells())}
    with pytest.raises(ValueError, match="not a data-parallel replica"):
        compute_delta(
            job="j",
            plan_id="p",
            layout=layout,
            assignment=assignment,
            generations=dict.fromkeys(layout.all_groups(), 0),
            moves={"m1": "s0"},
            sources={"m1": "m2"},
        )
