"""The delta of a migration: which groups a plan rebuilds, and with whom (pure, no torch)."""

import sys

import pytest

from trainmover.runtime.layout import Layout, MachineRole, Role
from trainmover.runtime.plan import RankRef, compute_delta, group_specs

LAYOUT = Layout(tp=2, pp=2, dp=2)
ASSIGNMENT = {f"m{i}": cell for i, cell in enumerate(LAYOUT.cells())}
GENERATIONS = dict.fromkeys(LAYOUT.all_groups(), 0)


def plan_for(moves, full=False, generations=GENERATIONS):
    return compute_delta(
        job="j",
        plan_id="p1",
        layout=LAYOUT,
        assignment=ASSIGNMENT,
        generations=generations,
        moves=moves,
        full=full,
    )


def test_layout_has_one_group_of_each_kind_per_role():
    groups = LAYOUT.all_groups()
    assert len(groups) == 12  # 4 tp + 4 pp + 4 dp
    assert groups["pp.d1.t0"] == ("pp", [Role(dp=1, pp=0, tp=0), Role(dp=1, pp=1, tp=0)])
    assert groups["dp.p1.t1"] == ("dp", [Role(dp=0, pp=1, tp=1), Role(dp=1, pp=1, tp=1)])


def test_delta_of_first_stage_machine_is_its_tp_pp_and_dp_groups():
    plan = plan_for({"m0": "s0"})
    assert [g.name for g in plan.groups] == [
        "dp.p0.t0",
        "dp.p0.t1",
        "pp.d0.t0",
        "pp.d0.t1",
        "tp.d0.p0",
    ]
    assert all(g.generation == 1 for g in plan.groups)
    assert plan.leavers() == {"m0"} and plan.joiners() == {"s0"}
    assert plan.stayers() == {"m1", "m2"}  # pipeline peer and DP peer; m3 is untouched


def test_joiner_takes_the_leavers_exact_group_ranks():
    plan = plan_for({"m3": "s0"})
    by_name = {g.name: g for g in plan.groups}
    assert by_name["dp.p1.t1"].members == [
        RankRef(machine="m1", local_rank=1),
        RankRef(machine="s0", local_rank=1),
    ]
    assert by_name["pp.d1.t0"].members == [
        RankRef(machine="m2", local_rank=0),
        RankRef(machine="s0", local_rank=0),
    ]
    assert [t.members for t in plan.transfers] == [
        [RankRef(machine="m3", local_rank=0), RankRef(machine="s0", local_rank=0)],
        [RankRef(machine="m3", local_rank=1), RankRef(machine="s0", local_rank=1)],
    ]


def test_two_machines_in_one_plan_rebuild_the_union_once():
    plan = plan_for({"m1": "s0", "m2": "s1"})
    names = [g.name for g in plan.groups]
    assert len(names) == len(set(names)) == 10  # only tp.d0.p0 and tp.d1.p1 stay
    assert {"tp.d0.p0", "tp.d1.p1"}.isdisjoint(names)
    assert plan.stayers() == {"m0", "m3"}


def test_generations_advance_from_the_current_ones_and_prefixes_never_repeat():
    gens = {**GENERATIONS, "pp.d0.t0": 3}
    plan = plan_for({"m0": "s0"}, generations=gens)
    spec = next(g for g in plan.groups if g.name == "pp.d0.t0")
    assert spec.generation == 4
    assert spec.store_prefix("j") == "j/pp.d0.t0/g4/"
    initial = group_specs(LAYOUT, ASSIGNMENT, gens, ["pp.d0.t0"])[0]
    assert initial.store_prefix("j") != spec.store_prefix("j")


def test_full_rebuild_plan_covers_every_group():
    assert len(plan_for({"m0": "s0"}, full=True).groups) == 12


def test_build_order_is_global_so_ranks_cannot_wait_on_each_other():
    plan = plan_for({"m1": "s0", "m2": "s1"})
    for machine in ["m0", "m3", "s0", "s1"]:
        names = [s.name for s in plan.specs_for(RankRef(machine=machine, local_rank=0))]
        assert names == sorted(names)


@pytest.mark.parametrize("moves", [{"s9": "s0"}, {"m0": "m1"}, {"m0": "s0", "m1": "s0"}])
def test_invalid_moves_are_refused(moves):
    with pytest.raises(ValueError):
        plan_for(moves)


def test_planner_modules_do_not_import_torch():
    import subprocess

    code = (
        "import sys, trainmover.runtime.plan, trainmover.runtime.layout; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_machine_roles_are_indexed_by_local_rank():
    assert LAYOUT.roles_of(MachineRole(dp=1, pp=0)) == [
        Role(dp=1, pp=0, tp=0),
        Role(dp=1, pp=0, tp=1),
    ]
