"""Which control requests a rank accepts or refuses: the pure state machine, no processes."""

from dataclasses import dataclass

import pytest

from trainmover.runtime.acceptance import Acceptance, Planned, part_in
from trainmover.runtime.layout import Layout, Role
from trainmover.runtime.plan import Plan, RankRef, compute_delta

LAYOUT = Layout(tp=2, pp=2, dp=2)
# m0 = (dp 0, pp 0), m1 = (0, 1), m2 = (1, 0), m3 = (1, 1); s0, s1 are standbys.
ASSIGNMENT = {f"m{i}": cell for i, cell in enumerate(LAYOUT.cells())}
TOTAL_STEPS = 20


def plan(plan_id: str = "p1", leaver: str = "m0", joiner: str = "s0", **kw: object) -> Plan:
    generations = dict.fromkeys(LAYOUT.all_groups(), kw.pop("generation", 0))
    return compute_delta(
        job="j",
        plan_id=plan_id,
        layout=LAYOUT,
        assignment=ASSIGNMENT,
        generations=generations,
        moves={leaver: joiner},
        **kw,  # type: ignore[arg-type]
    )


def recover_plan(plan_id: str = "r1", **kw: object) -> Plan:
    """m0 failed; its joiner s0 gets m0's state from its replica m2."""
    return plan(plan_id, sources={"m0": "m2"}, **kw)


@dataclass
class FakeBuild:
    done: bool = False
    error: BaseException | None = None
    discarded: bool = False

    def discard(self) -> None:
        self.discarded = True


def rank(machine: str, *, role: bool = True, limit: int = 10) -> Acceptance:
    """A rank of `machine` (local rank 0); an active one has its machine's role."""
    acc = Acceptance(RankRef(machine=machine, local_rank=0), total_steps=TOTAL_STEPS, limit=limit)
    if role and machine in ASSIGNMENT:
        acc.role = LAYOUT.roles_of(ASSIGNMENT[machine])[0]
    return acc


def prepared(acc: Acceptance, p: Plan, build: FakeBuild | None = None) -> Planned:
    decision = acc.prepare(p, {})
    return acc.prepared(p, decision.part, build or FakeBuild())


# -- parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "part"),
    [("m0", "leaver"), ("s0", "joiner"), ("m1", "stayer"), ("m2", "stayer"), ("m3", "stayer")],
)
def test_part_in_a_planned_migration(machine: str, part: str) -> None:
    assert part_in(plan(), machine, recovery=False) == part


@pytest.mark.parametrize(
    ("machine", "part"),
    [("s0", "joiner"), ("m2", "source"), ("m0", "stayer"), ("m1", "stayer")],
)
def test_part_in_a_recovery_the_replica_is_the_source(machine: str, part: str) -> None:
    assert part_in(recover_plan(), machine, recovery=True) == part


def test_part_in_a_checkpoint_recovery_nobody_is_a_source() -> None:
    p = plan("r1", restore="checkpoint")
    assert {part_in(p, m, recovery=True) for m in ASSIGNMENT} == {"stayer"}


# -- phase 1 -----------------------------------------------------------------------------


def test_stayer_accepts_phase_one_and_builds_its_delta_groups() -> None:
    acc = rank("m1")
    decision = acc.prepare(plan(), {"tp": 0, "pp": 0, "dp": 0})
    assert decision.part == "stayer" and not decision.retry
    assert decision.take is None and decision.replaced is None
    assert [s.name for s in decision.specs] == ["pp.d0.t0"]
    assert acc.prepared(plan(), decision.part, FakeBuild()) is acc.planned


def test_unaffected_stayer_accepts_with_nothing_to_build() -> None:
    decision = rank("m3").prepare(plan(), {})
    assert decision.part == "stayer" and decision.specs == []


def test_joiner_takes_the_leavers_role_of_its_local_rank() -> None:
    acc = Acceptance(RankRef(machine="s0", local_rank=1), total_steps=TOTAL_STEPS)
    decision = acc.prepare(plan(), {})
    assert decision.part == "joiner"
    assert decision.take == acc.role == Role(dp=0, pp=0, tp=1)
    assert any(s.kind == "transfer" for s in decision.specs)


def test_leaver_is_not_checked_for_generations() -> None:
    decision = rank("m0").prepare(plan(), {"tp": 5, "pp": 5, "dp": 5})
    assert decision.part == "leaver"


def test_stale_plan_is_refused_by_a_stayer_naming_the_group() -> None:
    acc = rank("m1")
    with pytest.raises(ValueError, match="pp.d0.t0: plan generation 1, current 1"):
        acc.prepare(plan(), {"pp": 1})
    assert acc.planned is None


def test_skipped_generations_are_accepted() -> None:
    # Those of a plan that ended in phase 1 stay claimed.
    assert rank("m1").prepare(plan(generation=3), {"pp": 1}).part == "stayer"


def test_prepare_retry_of_the_same_plan_is_answered_as_before() -> None:
    acc = rank("m1")
    first = prepared(acc, plan())
    decision = acc.prepare(plan(), {"pp": 5})  # not checked again
    assert decision.retry and decision.part == "stayer"
    assert [s.name for s in decision.specs] == ["pp.d0.t0"]
    assert acc.planned is first


def test_a_committed_plan_refuses_another() -> None:
    acc = rank("m1")
    prepared(acc, plan(), FakeBuild(done=True))
    assert acc.commit("p1", 5).accepted
    with pytest.raises(RuntimeError, match="plan p1 still in flight"):
        acc.prepare(plan("p2", generation=1), {})


def test_a_joiner_in_phase_one_refuses_another_plan() -> None:
    acc = rank("s0", role=False)
    prepared(acc, plan())
    with pytest.raises(RuntimeError, match="still in flight"):
        acc.prepare(plan("p2", generation=1), {})


def test_a_plan_for_other_groups_waits_for_the_one_in_phase_one() -> None:
    acc = rank("m2")  # in m0's delta (dp.p0), not in m3's
    prepared(acc, plan())
    with pytest.raises(RuntimeError, match="still in flight"):
        acc.prepare(plan("p2", leaver="m3", joiner="s1"), {})


def test_a_newer_plan_for_the_same_groups_replaces_one_in_phase_one() -> None:
    acc = rank("m1")
    old = prepared(acc, plan())
    decision = acc.prepare(plan("p2", joiner="s1", generation=1), {"pp": 0})
    assert decision.replaced is old and not decision.retry
    assert acc.planned is None  # until the new build starts
    assert acc.commit("p1", 5).reason == "unknown plan"


# -- phase 2 -----------------------------------------------------------------------------


def test_commit_of_an_unknown_plan_is_refused() -> None:
    acc = rank("m1")
    assert acc.commit("p1", 5).reason == "unknown plan"
    prepared(acc, plan(), FakeBuild(done=True))
    decision = acc.commit("p9", 5)
    assert not decision.accepted and decision.reason == "unknown plan"


@pytest.mark.parametrize("build", [FakeBuild(done=False), FakeBuild(done=True, error=OSError())])
def test_commit_before_the_groups_are_built_is_refused(build: FakeBuild) -> None:
    acc = rank("m1")
    prepared(acc, plan(), build)
    assert acc.commit("p1", 5).reason == "not ready"
    assert acc.planned is not None and acc.planned.commit_step is None


def test_commit_at_a_passed_step_is_refused() -> None:
    acc = rank("m1")
    prepared(acc, plan(), FakeBuild(done=True))
    assert acc.at_boundary(4, aborted=False) == "train"
    assert acc.passed == 4
    assert acc.commit("p1", 4).reason == "too late"
    assert acc.commit("p1", 5).accepted


def test_a_joiner_accepts_any_commit_step() -> None:
    acc = rank("s0", role=False)
    prepared(acc, plan(), FakeBuild(done=True))
    acc.passed = 9
    assert acc.commit("p1", 3).accepted


def test_accepted_commit_records_the_switch_step() -> None:
    acc = rank("m0")
    mig = prepared(acc, plan(), FakeBuild(done=True))
    decision = acc.commit("p1", 6)
    assert decision.accepted and decision.reason == ""
    assert mig.commit_step == 6


def test_commit_retry_of_the_same_step_is_answered_as_before() -> None:
    acc = rank("m1")
    mig = prepared(acc, plan(), FakeBuild(done=True))
    first = acc.commit("p1", 6)
    assert (first.accepted, first.retry, first.part) == (True, False, "stayer")
    acc.at_boundary(6, aborted=False)  # even once the rank stands at k
    again = acc.commit("p1", 6)
    assert (again.accepted, again.retry) == (True, True)
    assert mig.commit_step == 6


def test_a_refusal_names_the_part_of_a_known_plan_only() -> None:
    acc = rank("m0")
    prepared(acc, plan(), FakeBuild())
    assert acc.commit("p1", 5).part == "leaver"  # not ready
    assert acc.commit("p9", 5).part is None


def test_a_dropped_switch_step_is_forgotten_and_the_rank_trains_past_it() -> None:
    acc = rank("m0")
    mig = prepared(acc, plan(), FakeBuild(done=True))
    acc.commit("p1", 5)
    assert acc.at_boundary(5, aborted=False) == "switch"
    acc.dropped(mig, 5)
    assert mig.commit_step is None
    assert acc.at_boundary(5, aborted=False) == "train"
    assert acc.commit("p1", 5).reason == "too late"
    assert acc.commit("p1", 8).accepted and mig.commit_step == 8


def test_dropping_an_older_step_keeps_the_one_that_replaced_it() -> None:
    acc = rank("s0", role=False)
    mig = prepared(acc, plan(), FakeBuild(done=True))
    acc.commit("p1", 5)
    acc.commit("p1", 9)  # the next round's k reached the joiner before it read k's drop
    acc.dropped(mig, 5)
    assert mig.commit_step == 9 and acc.join(mig) == "commit"


# -- boundaries --------------------------------------------------------------------------


def test_boundary_trains_up_to_the_limit_then_waits() -> None:
    acc = rank("m1", limit=3)
    assert [acc.at_boundary(s, aborted=False) for s in range(4)] == [
        "train",
        "train",
        "train",
        "wait",
    ]
    assert acc.passed == 2
    acc.limit = 4
    assert acc.at_boundary(3, aborted=False) == "train"


def test_steps_trained_during_the_build_are_counted() -> None:
    acc = rank("m1")
    build = FakeBuild()
    mig = prepared(acc, plan(), build)
    acc.at_boundary(1, aborted=False)
    acc.at_boundary(2, aborted=False)
    build.done = True
    acc.at_boundary(3, aborted=False)
    assert mig.steps_during_build == 2


def test_boundary_switches_at_the_commit_step_only() -> None:
    acc = rank("m1")
    prepared(acc, plan(), FakeBuild(done=True))
    acc.commit("p1", 5)
    assert acc.at_boundary(4, aborted=False) == "train"
    assert acc.at_boundary(5, aborted=False) == "switch"


def test_switch_at_the_last_step_comes_before_finishing() -> None:
    acc = rank("m1", limit=TOTAL_STEPS + 1)
    prepared(acc, plan(), FakeBuild(done=True))
    acc.commit("p1", TOTAL_STEPS)
    assert acc.at_boundary(TOTAL_STEPS, aborted=False) == "switch"
    acc.switched(acc.planned)  # type: ignore[arg-type]
    assert acc.at_boundary(TOTAL_STEPS, aborted=False) == "finish"


def test_boundary_finishes_when_stopped() -> None:
    acc = rank("m1")
    acc.stopped = True
    assert acc.at_boundary(2, aborted=False) == "finish"
    assert acc.passed == -1


def test_no_step_starts_in_an_aborted_epoch() -> None:
    acc = rank("m1")
    assert acc.at_boundary(2, aborted=True) == "wait"
    acc.stopped = True
    assert acc.at_boundary(2, aborted=True) == "finish"


def test_a_recover_plan_comes_first_at_the_boundary() -> None:
    acc = rank("m1")
    prepared(acc, plan(), FakeBuild(done=True))
    acc.commit("p1", 5)
    acc.recover(recover_plan())
    assert acc.at_boundary(5, aborted=True) == "recover"


# -- a joiner's first boundary -----------------------------------------------------------


def test_joiner_waits_for_the_commit() -> None:
    acc = rank("s0", role=False)
    mig = prepared(acc, plan(), FakeBuild(done=True))
    assert acc.join(mig) == "wait"
    acc.commit("p1", 4)
    assert acc.join(mig) == "commit"


def test_joiner_superseded_by_a_recovery_before_the_commit() -> None:
    acc = rank("s0", role=False)
    mig = prepared(acc, plan(), FakeBuild(done=True))
    acc.recover(recover_plan())
    assert acc.planned is None
    assert acc.join(mig) == "superseded"


def test_joiner_committed_before_the_recovery_still_joins() -> None:
    acc = rank("s0", role=False)
    mig = prepared(acc, plan(), FakeBuild(done=True))
    acc.commit("p1", 4)
    acc.recover(recover_plan())
    assert acc.join(mig) == "commit"


def test_joiner_stopped_before_the_commit() -> None:
    acc = rank("s0", role=False)
    mig = prepared(acc, plan(), FakeBuild(done=True))
    acc.stopped = True
    assert acc.join(mig) == "stopped"


def test_switched_forgets_only_its_own_migration() -> None:
    acc = rank("m1")
    old = prepared(acc, plan())
    acc.prepare(plan("p2", joiner="s1", generation=1), {})
    new = acc.prepared(plan("p2", joiner="s1", generation=1), "stayer", FakeBuild())
    acc.switched(old)
    assert acc.planned is new
    acc.switched(new)
    assert acc.planned is None


# -- failures ----------------------------------------------------------------------------


def test_recover_supersedes_the_planned_migration_in_flight() -> None:
    acc = rank("m1")
    mig = prepared(acc, plan(), FakeBuild(done=True))
    decision = acc.recover(recover_plan())
    assert decision.part == "stayer" and decision.discarded is mig and not decision.retry
    assert acc.planned is None
    assert acc.recovering is not None and acc.recovering.plan.plan_id == "r1"
    assert acc.commit("p1", 5).reason == "unknown plan"


def test_recover_retry_is_answered_as_before() -> None:
    acc = rank("m2")
    acc.recover(recover_plan())
    decision = acc.recover(recover_plan())
    assert decision.retry and decision.part == "source" and decision.discarded is None


def test_recover_while_another_recovery_runs_is_refused() -> None:
    acc = rank("m1")
    acc.recover(recover_plan("r1"))
    with pytest.raises(RuntimeError, match="recovery r1 still in flight"):
        acc.recover(recover_plan("r2", generation=1))


def test_a_superseding_plan_replaces_the_recovery_and_the_old_one_is_refused() -> None:
    acc = rank("m1")
    acc.recover(recover_plan("r1"))
    decision = acc.recover(recover_plan("r2", generation=1, supersedes=["r1"]))
    assert not decision.retry
    assert acc.recovering is not None and acc.recovering.plan.plan_id == "r2"
    assert acc.superseded == {"r1"}
    with pytest.raises(ValueError, match="plan r1 was superseded"):
        acc.recover(recover_plan("r1"))


def test_recover_names_a_standby_that_is_not_its_joiner() -> None:
    with pytest.raises(ValueError, match="a standby that is not the plan's joiner"):
        rank("s1", role=False).recover(recover_plan())


def test_standby_joiner_takes_its_role_on_recover() -> None:
    acc = rank("s0", role=False)
    decision = acc.recover(recover_plan())
    assert decision.part == "joiner"
    assert decision.take == acc.role == Role(dp=0, pp=0, tp=0)


def test_joiner_kept_by_a_superseding_plan_keeps_its_role() -> None:
    acc = rank("s0", role=False)
    acc.recover(recover_plan("r1"))
    decision = acc.recover(recover_plan("r2", generation=1, supersedes=["r1"]))
    assert decision.part == "joiner" and decision.take is None


def test_joiner_with_another_role_is_refused() -> None:
    acc = rank("s0", role=False)
    acc.role = Role(dp=1, pp=1, tp=0)
    with pytest.raises(ValueError, match="the joiner already has another role"):
        acc.recover(recover_plan())
    assert acc.recovering is None


def test_recovered_forgets_only_its_own_plan() -> None:
    acc = rank("m1")
    acc.recover(recover_plan("r1"))
    first = acc.recovering
    acc.recover(recover_plan("r2", generation=1, supersedes=["r1"]))
    acc.recovered(first)  # type: ignore[arg-type]
    assert acc.recovering is not None and acc.recovering.plan.plan_id == "r2"
    acc.recovered(acc.recovering)
    assert acc.recovering is None
