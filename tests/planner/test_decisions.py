"""The planner's rules, as pure functions of state and input (no bus, no processes)."""

from __future__ import annotations

import pytest

from tests.conftest import sample_state
from trainmover.messages import (
    ClusterState,
    DrainEvent,
    FailureEvent,
    Heartbeat,
    MachineState,
    MigrationProgress,
    RebalanceEvent,
    StragglerEvent,
    StragglerEvidence,
    WorkerStatus,
)
from trainmover.runtime.layout import Layout
from trainmover.services.planner.decisions import Planner

JOB = "j"
NOW = 1000.0


@pytest.fixture
def planner() -> Planner:
    return Planner(straggler_cooldown_s=60)


def drain(machine: str, **kw) -> DrainEvent:
    return DrainEvent(job=JOB, machine=machine, **kw)


def failure(machine: str) -> FailureEvent:
    return FailureEvent(job=JOB, machine=machine, source="heartbeat")


def straggler(machine: str) -> StragglerEvent:
    evidence = StragglerEvidence(machine_median_s=0.3, job_median_s=0.1, factor=1.5, window=8)
    return StragglerEvent(job=JOB, machine=machine, evidence=evidence)


def warm_beat(machine: str, types=("first", "last"), exited: bool = False) -> Heartbeat:
    workers = [
        WorkerStatus(
            local_rank=0, state="exited" if exited else "standby", exit_code=1 if exited else None
        )
    ]
    return Heartbeat(
        job=JOB,
        machine=machine,
        seq=1,
        status="standby",
        workers=workers,
        warm_role_types=list(types),
    )


def statuses(state: ClusterState) -> dict[str, str]:
    return {n: m.status for n, m in state.machines.items()}


def test_role_types_by_pipeline_position():
    lay = Layout(tp=1, pp=4, dp=1)
    assert [lay.role_type(c.pp) for c in lay.cells()] == ["first", "middle", "middle", "last"]
    assert Layout(tp=2, pp=1, dp=2).role_types() == ["only"]


def test_drain_plans_a_planned_migration_with_the_delta(planner):
    out = planner.on_event(sample_state(JOB), drain("m0", deadline_s=30, ts=NOW), NOW)
    (plan,) = out.plans
    assert plan.migration == "planned" and plan.state_sources == {"m0": "m0"}
    assert [(m.leaver, m.joiner) for m in plan.moves] == [("m0", "s0")]
    assert plan.deadline_ts == NOW + 30
    # m0 is (dp0, pp0): its TP group, its two PP groups and its two DP groups.
    assert sorted(g.name for g in plan.groups) == [
        "dp.p0.t0",
        "dp.p0.t1",
        "pp.d0.t0",
        "pp.d0.t1",
        "tp.d0.p0",
    ]
    assert all(g.generation == 1 for g in plan.groups)
    assert statuses(out.state)["m0"] == "leaving" and statuses(out.state)["s0"] == "joining"
    assert out.state.in_flight == {plan.plan_id: plan}
    assert [p.state for p in out.progress] == ["planned"]


def test_duplicate_event_changes_nothing(planner):
    event = drain("m1")
    first = planner.on_event(sample_state(JOB), event, NOW)
    again = planner.on_event(first.state, event, NOW)
    assert again.state == first.state and not again.changed


@pytest.mark.parametrize(
    ("machine", "status", "reason"),
    [
        ("m9", None, "unknown machine 'm9'"),
        ("m1", "leaving", "already leaving"),
        ("m1", "failed", "already failed"),
    ],
)
def test_bad_drains_are_rejected_with_a_reason(planner, machine, status, reason):
    state = sample_state(JOB)
    if status:
        machines = dict(state.machines)
        machines[machine] = machines[machine].model_copy(update={"status": status})
        state = state.model_copy(update={"machines": machines})
    out = planner.on_event(state, drain(machine), NOW)
    assert not out.plans
    (progress,) = out.progress
    assert progress.state == "rejected" and reason in progress.detail
    assert out.state.machines == state.machines and not out.state.in_flight


def test_drain_waits_for_a_standby_then_runs(planner):
    state = sample_state(JOB, standbys=0)
    out = planner.on_event(state, drain("m3"), NOW)
    assert not out.plans and [p.state for p in out.progress] == ["queued"]
    assert [q.machine for q in out.state.queued] == ["m3"]
    admitted = planner.on_heartbeat(out.state, warm_beat("s7"), NOW)
    (plan,) = admitted.plans
    assert [(m.leaver, m.joiner) for m in plan.moves] == [("m3", "s7")]
    assert not admitted.state.queued


def test_a_second_drain_of_a_queued_machine_is_rejected(planner):
    waiting = planner.on_event(sample_state(JOB, standbys=0), drain("m3"), NOW)
    again = planner.on_event(waiting.state, drain("m3"), NOW)
    (progress,) = again.progress
    assert progress.state == "rejected" and "already queued to leave" in progress.detail
    assert again.state.queued == waiting.state.queued


def test_failure_recovers_from_a_data_parallel_replica(planner):
    out = planner.on_event(sample_state(JOB), failure("m1"), NOW)
    (plan,) = out.plans
    # m1 is (dp0, pp1); its replica is m3 (dp1, pp1).
    assert plan.migration == "unplanned" and plan.state_sources == {"m1": "m3"}


def test_failure_without_replica_falls_back_to_checkpoint(planner):
    layout = Layout(tp=2, pp=2, dp=1)
    machines = {
        f"m{i}": MachineState(status="active", cell=c) for i, c in enumerate(layout.cells())
    }
    machines["s0"] = MachineState(status="standby", warm_role_types=["first", "last"])
    state = ClusterState(job=JOB, layout=layout, machines=machines)
    out = planner.on_event(state, failure("m0"), NOW)
    (plan,) = out.plans
    assert plan.migration == "checkpoint_restart" and plan.state_sources == {}
    fallback = [p for p in out.progress if p.state == "fallback"]
    assert fallback and "no data-parallel replica" in fallback[0].detail


def test_failure_without_standby_says_fallback_and_waits(planner):
    out = planner.on_event(sample_state(JOB, standbys=0), failure("m2"), NOW)
    assert not out.plans
    (progress,) = out.progress
    assert progress.state == "fallback" and "no warm standby free" in progress.detail
    assert statuses(out.state)["m2"] == "leaving"
    later = planner.on_heartbeat(out.state, warm_beat("s5"), NOW)
    (plan,) = later.plans
    assert plan.migration == "unplanned" and plan.moves[0].joiner == "s5"


@pytest.mark.parametrize("second", ["m1", "m3"])
def test_a_failure_during_a_recovery_supersedes_it_with_one_plan(planner, second):
    """m1 shares m0's PP groups; m3 shares no group with m0, but a recovery involves every
    rank of the job: either way the two failures become one recovery of two moves."""
    first = planner.on_event(sample_state(JOB, standbys=2), failure("m0"), NOW)
    (old,) = first.plans
    event = failure(second)
    out = planner.on_event(first.state, event, NOW)
    (plan,) = out.plans
    assert plan.migration == "unplanned" and plan.event_id == event.event_id
    # m0 keeps the joiner it had; each leaver's state comes from its own live replica.
    replica = {"m1": "m3", "m3": "m1"}[second]
    assert {(m.leaver, m.joiner) for m in plan.moves} == {("m0", "s0"), (second, "s1")}
    assert plan.state_sources == {"m0": "m2", second: replica}
    assert plan.supersedes == [old.plan_id] and out.cancelled == [old.plan_id]
    assert plan.merged_events == {old.event_id: "m0"}
    assert list(out.state.in_flight) == [plan.plan_id]
    # The first plan's groups may be half built: the new incarnations skip their generation.
    generations = {g.name: g.generation for g in plan.groups}
    assert all(generations[g.name] == 2 for g in old.groups)
    assert {n: g for n, g in generations.items() if n not in {g.name for g in old.groups}}
    assert set(generations.values()) == {1, 2}
    # The first event is not ended: the new plan recovers it (its progress names the plan).
    assert {(p.event_id, p.state, p.plan_id) for p in out.progress} == {
        (event.event_id, "planned", plan.plan_id),
        (old.event_id, "planned", plan.plan_id),
    }
    assert all(p.moves == {"m0": "s0", second: "s1"} for p in out.progress)
    done = MigrationProgress(job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state="done")
    after = planner.on_progress(out.state, done, NOW)
    assert statuses(after.state) == {
        "m0": "failed",
        second: "failed",
        "s0": "active",
        "s1": "active",
        **{m: "active" for m in ("m1", "m2", "m3") if m != second},
    }
    assert after.state.generations == {**after.state.generations, **generations}


def test_both_replicas_of_a_cell_failing_fall_back_to_the_checkpoint(planner):
    """m0 and m2 hold pp0 in the two DP replicas: nothing alive has their state."""
    first = planner.on_event(sample_state(JOB, standbys=2), failure("m0"), NOW)
    out = planner.on_event(first.state, failure("m2"), NOW)
    (plan,) = out.plans
    assert plan.migration == "checkpoint_restart" and plan.restore == "checkpoint"
    assert {(m.leaver, m.joiner) for m in plan.moves} == {("m0", "s0"), ("m2", "s1")}
    assert plan.state_sources == {} and not plan.transfers
    (fallback,) = [p for p in out.progress if p.state == "fallback"]
    assert "checkpoint restart" in fallback.detail and "m0, m2" in fallback.detail
    assert "no data-parallel replica" in fallback.detail


def test_a_second_failure_without_standby_makes_both_wait(planner):
    first = planner.on_event(sample_state(JOB, standbys=1), failure("m0"), NOW)
    (old,) = first.plans
    event = failure("m1")
    out = planner.on_event(first.state, event, NOW)
    assert not out.plans and out.cancelled == [old.plan_id] and not out.state.in_flight
    assert [q.machine for q in out.state.queued] == ["m0", "m1"]
    # s0 may already hold m0's role: it is relaunched through maintenance.
    assert statuses(out.state) | {} == {
        "m0": "leaving",
        "m1": "leaving",
        "m2": "active",
        "m3": "active",
        "s0": "maintenance",
    }
    assert {(p.event_id, p.state) for p in out.progress} == {
        (old.event_id, "queued"),
        (event.event_id, "fallback"),
    }
    # One standby back is not enough for two roles; a second one starts one recovery.
    back = planner.on_heartbeat(out.state, warm_beat("s0"), NOW)
    assert not back.plans and statuses(back.state)["s0"] == "standby"
    both = planner.on_heartbeat(back.state, warm_beat("s7"), NOW)
    (plan,) = both.plans
    assert {m.leaver for m in plan.moves} == {"m0", "m1"} and not both.state.queued
    assert plan.state_sources == {"m0": "m2", "m1": "m3"}


def test_a_failure_during_a_planned_migration_aborts_it_and_requeues_the_drain(planner):
    drained = drain("m1", deadline_s=600, ts=NOW)
    planned = planner.on_event(sample_state(JOB, standbys=2), drained, NOW)
    (old,) = planned.plans
    out = planner.on_event(planned.state, failure("m2"), NOW + 1)
    (plan,) = out.plans
    assert plan.migration == "unplanned" and plan.supersedes == [old.plan_id]
    assert [(m.leaver, m.joiner) for m in plan.moves] == [("m2", "s1")]
    assert plan.state_sources == {"m2": "m0"} and not plan.merged_events
    # The drain keeps its event id and waits at the head of the queue; its leaver keeps
    # its role; its joiner may hold m1's role already, so it goes through maintenance.
    assert [(q.event_id, q.machine) for q in out.state.queued] == [(drained.event_id, "m1")]
    assert statuses(out.state)["m1"] == "active" and statuses(out.state)["s0"] == "maintenance"
    (note,) = [p for p in out.progress if p.event_id == drained.event_id]
    assert note.state == "queued" and "failure of m2" in note.detail
    # Nothing planned runs beside the recovery, even with a standby free.
    back = planner.on_heartbeat(out.state, warm_beat("s0"), NOW + 2)
    assert not back.plans and statuses(back.state)["s0"] == "standby"
    done = MigrationProgress(job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state="done")
    after = planner.on_progress(back.state, done, NOW + 3)
    (again,) = after.plans
    assert again.event_id == drained.event_id and again.migration == "planned"
    assert [(m.leaver, m.joiner) for m in again.moves] == [("m1", "s0")]
    assert again.deadline_ts is not None and again.deadline_ts <= NOW + 600 + 3
    # m1's groups were claimed at generation 1 by the aborted plan: now generation 2.
    assert {g.generation for g in again.groups} == {2}


def test_no_planned_migration_beside_a_recovery(planner):
    recovering = planner.on_event(sample_state(JOB, standbys=2), failure("m0"), NOW)
    (plan,) = recovering.plans
    waits = planner.on_event(recovering.state, drain("m3"), NOW)
    assert not waits.plans and [p.state for p in waits.progress] == ["queued"]
    slow = planner.on_event(waits.state, straggler("m3"), NOW)
    assert not slow.plans and slow.progress[0].state == "rejected"
    done = MigrationProgress(job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state="done")
    (queued_plan,) = planner.on_progress(slow.state, done, NOW).plans
    assert queued_plan.moves[0].leaver == "m3"


def test_dead_joiner_of_a_recovery_is_replaced(planner):
    first = planner.on_event(sample_state(JOB, standbys=2), failure("m0"), NOW)
    (old,) = first.plans
    out = planner.on_event(first.state, failure("s0"), NOW)
    (plan,) = out.plans
    assert plan.event_id == old.event_id and plan.supersedes == [old.plan_id]
    assert [(m.leaver, m.joiner) for m in plan.moves] == [("m0", "s1")]
    assert statuses(out.state)["s0"] == "failed" and out.cancelled == [old.plan_id]


def test_leaver_dying_mid_drain_switches_to_the_failure_path(planner):
    planned = planner.on_event(sample_state(JOB), drain("m0"), NOW)
    old = planned.plans[0]
    out = planner.on_event(planned.state, failure("m0"), NOW)
    (plan,) = out.plans
    assert out.cancelled == [old.plan_id]
    assert plan.migration == "unplanned" and plan.state_sources == {"m0": "m2"}
    assert plan.moves[0].joiner == "s0"  # the same standby, released and taken again
    assert list(out.state.in_flight) == [plan.plan_id]
    aborted = [p for p in out.progress if p.state == "aborted"]
    assert aborted and aborted[0].event_id == old.event_id


def test_dead_standby_leaves_the_pool(planner):
    out = planner.on_event(sample_state(JOB), failure("s0"), NOW)
    assert statuses(out.state)["s0"] == "failed" and not out.plans
    after = planner.on_event(out.state, drain("m0"), NOW)
    assert [p.state for p in after.progress] == ["queued"]


def test_dead_joiner_is_replaced_by_another_standby(planner):
    planned = planner.on_event(sample_state(JOB, standbys=2), drain("m1"), NOW)
    out = planner.on_event(planned.state, failure("s0"), NOW)
    (plan,) = out.plans
    assert plan.moves[0].joiner == "s1" and plan.event_id == planned.plans[0].event_id
    assert out.cancelled == [planned.plans[0].plan_id]
    assert statuses(out.state)["s0"] == "failed"
    # Stayers may still be building the cancelled plan's groups: the replacement takes
    # newer generations (other store prefixes) for every one of them.
    old = {g.name: g.generation for g in planned.plans[0].groups}
    assert all(g.generation > old[g.name] for g in plan.groups if g.name in old)
    assert old.items() <= out.state.claimed_generations.items()


def test_a_leaver_dying_after_the_switch_does_not_undo_the_migration(planner):
    planned = planner.on_event(sample_state(JOB), drain("m2"), NOW)
    plan = planned.plans[0]
    releasing = MigrationProgress(
        job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state="releasing"
    )
    out = planner.on_progress(planned.state, releasing, NOW)
    # Every rank switched: the job runs on the joiner, whatever happens to the leaver.
    assert statuses(out.state)["s0"] == "active" and statuses(out.state)["m2"] == "maintenance"
    assert not out.state.in_flight
    dead = planner.on_event(out.state, failure("m2"), NOW)
    assert not dead.plans and not dead.cancelled
    assert statuses(dead.state)["s0"] == "active"
    # The executor's "done" that follows changes nothing more.
    done = releasing.model_copy(update={"state": "done"})
    assert planner.on_progress(dead.state, done, NOW).state == dead.state


def test_done_makes_the_joiner_active_and_bumps_generations(planner):
    planned = planner.on_event(sample_state(JOB), drain("m2"), NOW)
    plan = planned.plans[0]
    done = MigrationProgress(job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state="done")
    out = planner.on_progress(planned.state, done, NOW)
    assert statuses(out.state)["s0"] == "active" and statuses(out.state)["m2"] == "maintenance"
    assert out.state.machines["s0"].cell == sample_state(JOB).machines["m2"].cell
    assert {g.name: g.generation for g in plan.groups}.items() <= out.state.generations.items()
    assert not out.state.in_flight
    # The drained machine comes back warm from maintenance and is admitted.
    back = planner.on_heartbeat(out.state, warm_beat("m2"), NOW)
    assert statuses(back.state)["m2"] == "standby"
    # m0 shares the DP groups of pp0 with m2's old role: they go to generation 2, the
    # groups only m0 has to generation 1; members follow the new assignment.
    again = planner.on_event(back.state, drain("m0"), NOW)
    generations = {g.name: g.generation for g in again.plans[0].groups}
    assert generations == {
        "dp.p0.t0": 2,
        "dp.p0.t1": 2,
        "pp.d0.t0": 1,
        "pp.d0.t1": 1,
        "tp.d0.p0": 1,
    }
    dp_group = next(g for g in again.plans[0].groups if g.name == "dp.p0.t0")
    assert [r.machine for r in dp_group.members] == ["m2", "s0"]


def test_failed_migration_rolls_back(planner):
    planned = planner.on_event(sample_state(JOB), drain("m2"), NOW)
    plan = planned.plans[0]
    failed = MigrationProgress(
        job=JOB,
        event_id=plan.event_id,
        plan_id=plan.plan_id,
        state="failed",
        detail="phase 1 timed out",
    )
    out = planner.on_progress(planned.state, failed, NOW)
    # The joiner may hold the role: it is relaunched and returns to the pool once warm.
    assert statuses(out.state)["m2"] == "active" and statuses(out.state)["s0"] == "maintenance"
    assert not out.state.in_flight
    # Ranks may have built its groups: the next plan takes newer generations (found by the
    # chaos soak: the reused store prefix refused the next joiner's claim).
    back = planner.on_heartbeat(out.state, warm_beat("s0"), NOW)
    again = planner.on_event(back.state, drain("m2"), NOW)
    old = {g.name: g.generation for g in plan.groups}
    assert all(g.generation > old[g.name] for g in again.plans[0].groups)


def _ends(planner, outcome, state: str, cluster=None, detail="phase1: a group build failed"):
    """The executor's end (`state`) of `outcome`'s plan, applied to `cluster` (default:
    the outcome's state)."""
    plan = outcome.plans[0]
    progress = MigrationProgress(
        job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state=state, detail=detail
    )
    return plan, planner.on_progress(cluster or outcome.state, progress, NOW)


def test_a_drain_that_failed_before_its_switch_is_planned_again_until_its_tries_run_out(
    planner,
):
    state = sample_state(JOB, standbys=3)
    outcome = planner.on_event(state, drain("m2"), NOW)
    tries = [outcome.plans[0].retries_left]
    for _ in range(tries[0]):
        plan, outcome = _ends(planner, outcome, "retrying")
        # The leaver trains on; the same event runs again at once on another standby.
        assert statuses(outcome.state)["m2"] == "leaving"
        assert [p.state for p in outcome.progress] == ["queued", "planned"]
        assert "planned again" in outcome.progress[0].detail
        (again,) = outcome.plans
        assert again.event_id == plan.event_id and again.moves[0].joiner != plan.moves[0].joiner
        assert statuses(outcome.state)[plan.moves[0].joiner] == "maintenance"
        tries.append(again.retries_left)
    assert tries == list(range(tries[0], -1, -1)) and tries[0] >= 1
    # With no try left the executor says failed: the drain ends there.
    _, last = _ends(planner, outcome, "failed")
    assert statuses(last.state)["m2"] == "active" and not last.state.queued and not last.plans


def test_a_drain_retried_while_no_standby_is_free_waits_first_in_the_queue(planner):
    outcome = planner.on_event(sample_state(JOB, standbys=1), drain("m2"), NOW)
    other = planner.on_event(outcome.state, drain("m3"), NOW)  # queued: no standby
    plan, out = _ends(planner, outcome, "retrying", cluster=other.state)
    assert not out.plans and [q.machine for q in out.state.queued] == ["m2", "m3"]
    assert out.state.queued[0].retries_left == plan.retries_left - 1
    # A warm standby again: m2's drain runs first, with the tries it has left.
    back = planner.on_heartbeat(out.state, warm_beat(plan.moves[0].joiner), NOW)
    (again,) = back.plans
    assert again.event_id == plan.event_id and again.retries_left == plan.retries_left - 1


def test_a_retried_drain_whose_leaver_failed_meanwhile_ends_failed(planner):
    outcome = planner.on_event(sample_state(JOB, standbys=3), drain("m2"), NOW)
    plan = outcome.plans[0]
    failed = planner.on_event(outcome.state, failure("m2"), NOW)  # supersedes the drain
    assert failed.plans[0].migration == "unplanned"
    retrying = MigrationProgress(
        job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state="retrying"
    )
    late = planner.on_progress(failed.state, retrying, NOW)  # the cancelled plan's end
    assert not late.plans and late.state == failed.state


def test_a_straggler_move_is_not_retried(planner):
    outcome = planner.on_event(sample_state(JOB), straggler("m1"), NOW)
    assert outcome.plans[0].retries_left == 0
    rebalance = planner.on_event(sample_state(JOB), RebalanceEvent(job=JOB, machine="m1"), NOW)
    assert rebalance.plans[0].retries_left > 0


def test_straggler_cool_down_and_no_standby(planner):
    planned = planner.on_event(sample_state(JOB, standbys=2), straggler("m1"), NOW)
    plan = planned.plans[0]
    done = MigrationProgress(job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state="done")
    moved = planner.on_progress(planned.state, done, NOW)
    joiner = plan.moves[0].joiner
    again = planner.on_event(moved.state, straggler(joiner), NOW + 10)
    assert again.progress[0].state == "rejected" and "cool-down" in again.progress[0].detail
    no_pool = planner.on_event(sample_state(JOB, standbys=0), straggler("m1"), NOW)
    assert no_pool.progress[0].state == "rejected" and not no_pool.state.queued


def test_rebalance_without_a_machine_is_rejected(planner):
    out = planner.on_event(sample_state(JOB), RebalanceEvent(job=JOB), NOW)
    assert out.progress[0].state == "rejected"


def test_admission_needs_warm_up_and_healthy_workers(planner):
    state = sample_state(JOB, standbys=0)
    cold = planner.on_heartbeat(state, warm_beat("n1", types=()), NOW)
    sick = planner.on_heartbeat(state, warm_beat("n1", exited=True), NOW)
    assert "n1" not in cold.state.machines and "n1" not in sick.state.machines
    only_first = planner.on_heartbeat(state, warm_beat("n1", types=("first",)), NOW)
    assert only_first.state.machines["n1"].warm_role_types == ["first"]
    # A standby warm only for the first stage cannot take a last-stage role.
    out = planner.on_event(only_first.state, drain("m1"), NOW)
    assert [p.state for p in out.progress] == ["queued"]


def test_no_two_plans_rebuild_one_group_or_share_a_machine(planner):
    """m1 (dp0, pp1) and m3 (dp1, pp1) share the DP groups of pp1."""
    first = planner.on_event(sample_state(JOB, standbys=2), drain("m1"), NOW)
    (plan,) = first.plans
    slow = planner.on_event(first.state, straggler("m3"), NOW)
    assert not slow.plans and slow.progress[0].state == "rejected"
    assert "involves m3's groups" in slow.progress[0].detail
    waits = planner.on_event(slow.state, drain("m3"), NOW)
    assert not waits.plans and [p.state for p in waits.progress] == ["queued"]
    # m2 (dp1, pp0) shares no group with m1, but m3 would be a stayer of both plans (PP
    # of dp1 and DP of pp1), and a rank takes part in one migration at a time.
    assert not _rebuilding_free(planner, waits.state, "m2")
    done = MigrationProgress(job=JOB, event_id=plan.event_id, plan_id=plan.plan_id, state="done")
    after = planner.on_progress(waits.state, done, NOW)
    (queued_plan,) = after.plans  # the queued drain of m3 runs once m1's migration ended
    assert queued_plan.moves[0].leaver == "m3" and not after.state.queued


def _rebuilding_free(planner, state, machine) -> bool:
    return bool(planner.on_event(state, drain(machine), NOW).plans)
