"""Well-formed but wrong messages: none may add a machine, move a healthy one or stall.

The planner runs against a real nats-server; each forged message is followed by a
genuine one on the same subscription (a subscription's messages are handled in order),
so once the genuine one took effect the forged one has been handled too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NatsClient

from tests.conftest import register_job, sample_state
from tests.health_monitor.conftest import dead_letters_of
from trainmover import bus
from trainmover.messages import (
    ClusterState,
    CollectiveErrorReport,
    DrainEvent,
    FailureEvent,
    Heartbeat,
    MachineState,
    StallReport,
    StragglerEvent,
    StragglerEvidence,
    WorkerStatus,
)
from trainmover.runtime.config import JobConfig
from trainmover.services.executor.fencing import fenced_in, to_fence
from trainmover.services.health_monitor.plausible import (
    ReportRate,
    StepBounds,
    collective_error_problem,
    stall_problem,
)
from trainmover.services.health_monitor.stragglers import StragglerDetector
from trainmover.services.planner.decisions import Planner
from trainmover.services.planner.service import PlannerService
from trainmover.subjects import JobSubjects

pytestmark = pytest.mark.timeout(120)


def _beat(job: str, machine: str, instance: str, status: str = "standby") -> Heartbeat:
    return Heartbeat(
        job=job,
        machine=machine,
        seq=1,
        status=status,  # type: ignore[arg-type]
        workers=[WorkerStatus(local_rank=0, state="standby")],
        warm_role_types=["first", "last"] if status == "standby" else [],
        instance=instance,
    )


def _with(state: ClusterState, name: str, **changes: object) -> ClusterState:
    current = state.machines.get(name) or MachineState(status="standby")
    return state.model_copy(
        update={"machines": {**state.machines, name: current.model_copy(update=changes)}}
    )


@pytest.fixture
async def planner(nc: NatsClient, job: str) -> AsyncIterator[PlannerService]:
    # m2 failed while its workers of instance "old" held its role; s0 and s1 may join.
    state = _with(sample_state(job, standbys=0), "m2", status="failed", cell=None, instance="old")
    await register_job(nc, job, state)
    config = JobConfig(job=job).with_updates(cluster={"standbys": ["s0", "s1"]})
    service = PlannerService(nc, config)
    await service.start()
    yield service
    await service.stop()


async def test_heartbeats_do_not_make_members(nc: NatsClient, job: str, planner) -> None:
    s = JobSubjects(job)
    # A machine the job config does not name, and the fenced workers of a failed machine
    # (or a replay of their heartbeat), are not admitted; a real standby is.
    await nc.publish(s.heartbeat("ghost"), _beat(job, "ghost", "g1").to_json())
    await nc.publish(s.heartbeat("m2"), _beat(job, "m2", "old").to_json())
    await nc.publish(s.heartbeat("s0"), _beat(job, "s0", "fresh-s0").to_json())
    state = await asyncio.wait_for(bus.state_until(nc, job, lambda st: "s0" in st.machines), 30)
    assert "ghost" not in state.machines
    assert state.machines["m2"].status == "failed"
    assert state.machines["s0"].instance == "fresh-s0"
    # m2 relaunched (a new instance): now it is a standby again.
    await nc.publish(s.heartbeat("m2"), _beat(job, "m2", "new").to_json())
    back = await asyncio.wait_for(
        bus.state_until(nc, job, lambda st: st.machines["m2"].status == "standby"), 30
    )
    assert back.machines["m2"].instance == "new"


async def test_an_event_must_be_of_its_subjects_kind(nc: NatsClient, job: str, planner) -> None:
    letters = await dead_letters_of(nc, job)
    evidence = StragglerEvidence(machine_median_s=9.0, job_median_s=0.1, factor=2, window=10)
    forged = StragglerEvent(job=job, machine="m1", evidence=evidence)
    # A client may publish drains only: a straggler payload on the drain subject.
    await nc.jetstream().publish(JobSubjects(job).event("drain"), forged.to_json())
    letter = await letters.wait_for(lambda d: forged.event_id[:8] in d.payload)
    assert "a straggler event on" in letter.reason and letter.service == "planner"
    assert forged.event_id not in planner.state.handled
    assert planner.state.machines["m1"].status == "active"


def test_a_drain_of_a_standby_is_refused() -> None:
    out = Planner().on_event(sample_state("j"), DrainEvent(job="j", machine="s0"), time.time())
    (progress,) = out.progress
    assert progress.state == "rejected" and "s0 is a standby" in progress.detail
    assert out.state.machines["s0"].status == "standby"


def test_a_leaver_being_recovered_is_not_recovered_twice() -> None:
    planner = Planner()
    first = planner.on_event(sample_state("j"), FailureEvent(job="j", machine="m1"), 1.0)
    (plan,) = first.plans
    # Its fence (or its death) is reported again while the recovery runs.
    again = planner.on_event(first.state, FailureEvent(job="j", machine="m1"), 2.0)
    assert not again.plans and again.state.in_flight == {plan.plan_id: plan}
    assert "already being recovered" in again.progress[0].detail


def test_a_collective_error_must_name_a_shared_group() -> None:
    state = sample_state("j")  # m0 (dp0, pp0), m1 (dp0, pp1), m2 (dp1, pp0), m3 (dp1, pp1)

    def report(machine: str, peer: str, group: str) -> CollectiveErrorReport:
        return CollectiveErrorReport(job="j", machine=machine, peer=peer, group=group, error="x")

    assert collective_error_problem(state, report("m1", "m3", "dp.p1.t0")) is None
    assert collective_error_problem(state, report("m2", "m3", "pp.d1.t1")) is None
    outside = collective_error_problem(state, report("m0", "m3", "dp.p1.t0"))
    assert outside is not None and "m0 not in group 'dp.p1.t0'" in outside
    assert "has no group" in str(collective_error_problem(state, report("m0", "m1", "world")))
    assert "blames itself" in str(collective_error_problem(state, report("m0", "m0", "tp.d0.p0")))
    # A transfer pair of an in-flight plan is a group of its two members.
    planned = Planner().on_event(state, DrainEvent(job="j", machine="m1"), 1.0)
    (plan,) = planned.plans
    pair = plan.transfers[0].name
    assert collective_error_problem(planned.state, report("m1", "s0", pair)) is None
    assert collective_error_problem(planned.state, report("m0", "s0", pair)) is not None


def test_a_peer_closing_a_group_its_recovery_rebuilds_is_not_blamed() -> None:
    """m1 fails: its recovery rebuilds m1's groups with the joiner s0. m0 seeing s0 close
    one of them is the recovery at work; m0 blaming m1 itself is still believed."""
    state = sample_state("j")
    out = Planner().on_event(state, FailureEvent(job="j", machine="m1"), 1.0)
    (plan,) = out.plans
    joiner = plan.moves[0].joiner
    group = next(spec for spec in plan.groups if "m0" in {r.machine for r in spec.members})

    def report(peer: str) -> CollectiveErrorReport:
        return CollectiveErrorReport(job="j", machine="m0", peer=peer, group=group.name, error="x")

    problem = collective_error_problem(out.state, report(joiner))
    assert problem is not None and "rebuilds" in problem and joiner in problem
    assert collective_error_problem(out.state, report("m1")) is None
    assert collective_error_problem(state, report("m1")) is None  # no recovery in flight


def test_a_stall_report_is_believed_only_about_role_holders_and_their_own_ranks() -> None:
    state = sample_state("j")
    layout = state.layout
    ranks = {
        m: sorted(layout.global_rank(r) for r in layout.roles_of(state.machines[m].cell))
        for m in ("m1", "m3")
    }

    def stall(reporter: str, culprits: dict[str, list[int]]) -> StallReport:
        return StallReport(
            job="j", machine=reporter, epoch="e0", step=40, culprits=culprits,
            reason="no progress", waited_s=1.5, median_step_s=0.1,
        )  # fmt: skip

    assert stall_problem(state, stall("m0", {"m1": ranks["m1"]}), {}, None) is None
    # A rank of m3 voted and names its own blocked TP peer: believed.
    assert stall_problem(state, stall("m3", {"m3": ranks["m3"][:1]}), {}, None) is None
    problem = stall_problem(state, stall("s0", {"m1": ranks["m1"]}), {}, None)
    assert problem is not None and "s0 holds no role" in problem
    problem = stall_problem(state, stall("m0", {"m1": ranks["m3"]}), {}, None)
    assert problem is not None and "are not m1's" in problem
    problem = stall_problem(state, stall("m0", {"s0": [0]}), {}, None)
    assert problem is not None and "s0 holds no role" in problem
    problem = stall_problem(state, stall("m0", {"m1": ranks["m1"]}), {"m1": 40}, None)
    assert problem is not None and "reported step 40 done" in problem


def test_a_stall_report_is_believed_only_from_a_peer_for_the_jobs_step_while_it_is_quiet() -> None:
    state = sample_state("j")  # m0 (dp0 pp0), m1 (dp0 pp1), m2 (dp1 pp0), m3 (dp1 pp1)
    layout = state.layout

    def stall(reporter: str, culprit: str, step: int) -> StallReport:
        ranks = sorted(layout.global_rank(r) for r in layout.roles_of(state.machines[culprit].cell))
        return StallReport(
            job="j", machine=reporter, epoch="e0", step=step, culprits={culprit: ranks},
            reason="no progress", waited_s=1.5, median_step_s=0.1,
        )  # fmt: skip

    steps = {"m0": 40, "m1": 39, "m2": 40, "m3": 40}
    # m1's PP peer m0 and its DP peer m3 wait on it: believed once the job is quiet.
    assert stall_problem(state, stall("m0", "m1", 40), steps, 1.6) is None
    assert stall_problem(state, stall("m3", "m1", 41), steps, 1.6) is None
    # m2 shares no group with m1: it waits on nothing of m1's.
    problem = stall_problem(state, stall("m2", "m1", 40), steps, 1.6)
    assert problem is not None and "m1 shares no group with m2" in problem
    # A step the job has not reached.
    problem = stall_problem(state, stall("m0", "m1", 1_000_000_000), steps, 1.6)
    assert problem == "step 1000000000 is not the job's: its furthest machine reported step 40 done"
    assert stall_problem(state, stall("m0", "m1", 43), steps, 1.6) is not None
    # Steps are being reported done: the job trains.
    problem = stall_problem(state, stall("m0", "m1", 40), steps, 0.2)
    assert problem is not None and "the job is not stalled" in problem


def test_a_reporter_has_a_few_distinct_stalls_believed_per_window() -> None:
    rate = ReportRate(burst=2, window_s=60.0)
    assert rate.check("j", "m0", "e0", 40, now=0.0) is None
    assert rate.check("j", "m0", "e0", 40, now=1.0) is None  # its repeats are free
    assert rate.check("j", "m0", "e1", 90, now=10.0) is None
    problem = rate.check("j", "m0", "e2", 150, now=20.0)
    assert problem is not None and "m0 reported 2 stalls within 60s" in problem
    assert rate.check("j", "m1", "e2", 150, now=20.0) is None  # per reporter
    assert rate.check("j", "m0", "e2", 150, now=61.0) is None  # the oldest aged out


def test_stats_that_jump_are_not_believed_and_do_not_blind_the_detector() -> None:
    bounds = StepBounds(max_lead=100)
    for step in range(1, 30):
        for m in ("m0", "m1", "m2"):
            assert bounds.check("j", m, step) is None
    problem = bounds.check("j", "m1", 10_000_000)
    assert problem is not None and "ahead of the job" in problem
    assert bounds.check("j", "m1", 30) is None  # the real stream goes on

    # A detector that did believe a jump ahead (within the bound) judges the real,
    # lower steps that follow as a new stream instead of ignoring them for good.
    detector = StragglerDetector(factor=1.5, consecutive=3, window=8, warmup=2)
    for step in range(1, 10):
        for m in ("m0", "m2"):
            detector.observe("j", m, step, 0.1)
        detector.observe("j", "m1", step, 0.1)
    detector.observe("j", "m1", 100, 0.1)
    findings = [detector.observe("j", "m1", step, 0.5) for step in range(10, 14)]
    assert any(f is not None for f in findings)


def test_a_failed_machine_is_fenced_once_by_the_instance_it_ran() -> None:
    state = _with(sample_state("j"), "m2", instance="i2")
    failed = Planner().on_event(state, FailureEvent(job="j", machine="m2"), 1.0).state
    # As its recovery starts (it is a leaver of an unplanned plan): fenced at once.
    (fence,) = to_fence(state, failed)
    assert (fence.machine, fence.instance) == ("m2", "i2")
    assert to_fence(failed, failed) == []
    # An executor that starts later fences what it finds failed, when it knows the
    # instance; an unknown one may be a fresh standby already.
    done = _with(failed, "m2", status="failed", cell=None)
    assert [f.machine for f in to_fence(None, done)] == ["m2"]
    unknown = _with(done, "m2", instance=None)
    assert to_fence(None, unknown) == []


def test_a_sidecar_fences_itself_from_the_state_only_for_the_instance_it_runs() -> None:
    state = _with(sample_state("j"), "m2", instance="i2")
    assert not fenced_in(state, "m2", "i2")  # active, training
    recovering = Planner().on_event(state, FailureEvent(job="j", machine="m2"), 1.0).state
    assert fenced_in(recovering, "m2", "i2")  # the leaver of a recovery
    done = _with(recovering, "m2", status="failed", cell=None)
    assert fenced_in(done, "m2", "i2")
    # The fresh standby it became since, another machine, an unknown instance: no.
    assert not fenced_in(done, "m2", "i3")
    assert not fenced_in(done, "m1", "i2")
    assert not fenced_in(_with(done, "m2", instance=None), "m2", "i2")
