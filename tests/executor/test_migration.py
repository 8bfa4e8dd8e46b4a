"""The executor's `Migration` state machine alone: fake sidecars answer its commands in
this process (no NATS, no workers), so every step of the sequence and of a restart is
checked from what it sent, saved and published."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeout

from tests.conftest import sample_state
from trainmover.messages import (
    Command,
    CommandReply,
    DrainEvent,
    FailureEvent,
    MigrationProgress,
    Plan,
)
from trainmover.services.executor.migration import Migration, MigrationRecord
from trainmover.services.executor.switch import COMMIT_ROUNDS, TOO_LATE
from trainmover.services.planner.decisions import Planner

pytestmark = pytest.mark.timeout(30)

JOB = "j"
STEP_S = 0.5  # every rank's median step time
BEFORE_END = 1000.0  # the end of step k on the slowest stayer
AFTER_END = 1003.0  # the end of step k + 1 on the slowest rank after the switch


def drain_plan() -> Plan:
    """m0 drains to the standby s0; m1 (its pipeline peer) and m2 (its replica) stay."""
    out = Planner().on_event(sample_state(JOB), DrainEvent(job=JOB, machine="m0"), time.time())
    (plan,) = out.plans
    return plan


def failure_plan() -> Plan:
    out = Planner().on_event(sample_state(JOB), FailureEvent(job=JOB, machine="m0"), time.time())
    (plan,) = out.plans
    return plan


@dataclass
class Sidecars:
    """Every machine's sidecar as the executor sees it: ranks at step `passed` (a joiner
    takes any commit step, the others refuse one they passed), every command recorded;
    `refuse` names (op, machine) pairs that answer ok=False."""

    joiners: set[str]
    passed: int = 10
    refuse: set[tuple[str, str]] = field(default_factory=set)
    error: str = "no such plan"
    sent: list[Command] = field(default_factory=list)
    #: (op, machine) pairs that get no answer (their sender retries until cancelled),
    #: and those of them whose send was cancelled.
    silent: set[tuple[str, str]] = field(default_factory=set)
    cancelled: list[tuple[str, str]] = field(default_factory=list)

    async def send(self, command: Command) -> CommandReply:
        self.sent.append(command)
        if (command.op, command.machine) in self.silent:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append((command.op, command.machine))
                raise
        if (command.op, command.machine) in self.refuse:
            return CommandReply(command_id=command.command_id, ok=False, error=self.error)
        return CommandReply(command_id=command.command_id, ok=True, result=self._result(command))

    def _result(self, command: Command) -> dict[str, Any]:
        op, machine, args = command.op, command.machine, command.args
        if op == "status":
            return {"step": self.passed}
        if op == "prepare":  # answered once ready, with the step the machine reached
            return {"ranks": 2, "step": self.passed}
        if op == "commit":
            if machine not in self.joiners and int(args["step"]) <= self.passed:
                return {"accepted": 0, "refused": {f"{machine}/0": TOO_LATE}, "passed": self.passed}
            return {"accepted": 2, "refused": {}, "passed": self.passed}
        if op == "transfer":
            return {"step": 12, "t_end": AFTER_END - 1.0, "transfer_s": 0.25}
        if op == "steps":  # step k ends last on m1, step k + 1 on the joiner s0
            if int(args["step"]) == 12:
                t_end = BEFORE_END if machine == "m1" else BEFORE_END - 0.1
            else:
                t_end = AFTER_END if machine == "s0" else AFTER_END - 0.2
            return {"t_end": t_end, "median_step_s": STEP_S}
        return {}

    def ops(self) -> list[tuple[str, str]]:
        return [(c.op, c.machine) for c in self.sent]

    def machines(self, op: str) -> list[str]:
        return [c.machine for c in self.sent if c.op == op]


@dataclass
class Harness:
    sidecars: Sidecars
    saved: list[MigrationRecord] = field(default_factory=list)
    published: list[MigrationProgress] = field(default_factory=list)
    survivors: list[str] = field(default_factory=lambda: ["m0", "m1", "m2", "m3"])
    asked_survivors: int = 0
    #: Steps the ranks pass while the n-th recorded switch step is being written.
    passed_while_saving: list[int] = field(default_factory=list)
    #: (machine, progress states published so far) for each settle the migration asked.
    settled: list[tuple[str, list[str]]] = field(default_factory=list)
    #: Progress states whose first publish times out past the bus's failover.
    lost_publish: set[str] = field(default_factory=set)

    def migration(self, record: MigrationRecord) -> Migration:
        async def save(record: MigrationRecord) -> None:
            self.saved.append(record.model_copy(deep=True))
            if record.phase == "committing" and record.commit_step and self.passed_while_saving:
                self.sidecars.passed += self.passed_while_saving.pop(0)

        async def publish(progress: MigrationProgress) -> None:
            if progress.state in self.lost_publish:
                self.lost_publish.discard(progress.state)
                raise NatsTimeout
            self.published.append(progress)

        async def survivors() -> list[str]:
            self.asked_survivors += 1
            return list(self.survivors)

        async def settle(machine: str) -> None:
            self.settled.append((machine, self.states()))

        return Migration(
            None, record, save, publish, survivors, send=self.sidecars.send, settle=settle
        )

    def run(self, record: MigrationRecord) -> MigrationRecord:
        return asyncio.run(asyncio.wait_for(self.migration(record).run(), 10))

    def states(self) -> list[str]:
        return [p.state for p in self.published]


def harness(plan: Plan, **kw: Any) -> Harness:
    return Harness(Sidecars(joiners=set(plan.joiners()), **kw))


# -- a planned migration -----------------------------------------------------------------


def test_planned_migration_runs_every_state_in_order() -> None:
    plan = drain_plan()
    h = harness(plan)
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "done" and final.error is None
    assert h.states() == ["phase1", "committing", "transferring", "releasing", "done"]
    assert [r.phase for r in h.saved] == [
        "committing",
        "committing",  # k recorded before any commit(k) goes out
        "transferring",
        "releasing",
        "done",
    ]
    affected = sorted(plan.affected_machines())
    assert affected == ["m0", "m1", "m2", "s0"]
    assert sorted(h.sidecars.machines("prepare")) == affected
    assert h.sidecars.machines("release") == ["m0"]
    ops = [op for op, _ in h.sidecars.ops()]
    first = {op: ops.index(op) for op in ("prepare", "commit", "transfer", "release")}
    assert list(first) == sorted(first, key=first.__getitem__)
    # The switch step comes from the prepare replies: no round asks the steps again.
    assert "status" not in ops


def test_switch_step_is_picked_past_the_furthest_rank_and_reaches_joiners_first() -> None:
    plan = drain_plan()
    h = harness(plan, passed=10)
    final = h.run(MigrationRecord(plan=plan))
    assert final.commit_step == 12  # margin 2
    assert h.saved[1].commit_step == 12
    commits = [c for c in h.sidecars.sent if c.op == "commit"]
    assert commits[0].machine == "s0"
    assert {int(c.args["step"]) for c in commits} == {12}
    assert {c.machine for c in commits} == set(plan.affected_machines())


def test_downtime_is_measured_from_the_step_timelines() -> None:
    plan = drain_plan()
    h = harness(plan)
    final = h.run(MigrationRecord(plan=plan))
    # Before: step k on the stayers (m1 ends last); after: step k + 1, the joiner last.
    before = [c for c in h.sidecars.sent if c.op == "steps" and int(c.args["step"]) == 12]
    assert sorted(c.machine for c in before) == ["m1", "m2"]
    assert final.phases["downtime"] == pytest.approx(AFTER_END - BEFORE_END - STEP_S)
    assert final.phases["transfer"] == 0.25
    assert final.phases["first_step"] == pytest.approx(1.0)
    (done,) = [p for p in h.published if p.state == "done"]
    assert done.downtime_s == final.phases["downtime"]
    assert done.groups_rebuilt == sorted(g.name for g in plan.groups)


def test_command_ids_are_derived_from_plan_op_machine_and_step() -> None:
    plan = drain_plan()
    h = harness(plan)
    h.run(MigrationRecord(plan=plan))
    ids = {(c.op, c.machine): c.command_id for c in h.sidecars.sent}
    assert ids[("prepare", "m1")] == f"{plan.plan_id}.prepare.m1"
    assert ids[("commit", "s0")] == f"{plan.plan_id}.commit.s0.12"
    again = harness(plan)
    again.run(MigrationRecord(plan=plan))
    assert [c.command_id for c in again.sidecars.sent] == [c.command_id for c in h.sidecars.sent]


def test_an_executor_restarted_before_its_switch_step_asks_where_the_ranks_are() -> None:
    plan = drain_plan()
    h = harness(plan, passed=30)  # the ranks trained on while no executor ran
    final = h.run(MigrationRecord(plan=plan, phase="committing"))
    ops = [op for op, _ in h.sidecars.ops()]
    assert "prepare" not in ops
    assert sorted(h.sidecars.machines("status")) == sorted(plan.affected_machines())
    assert ops.index("status") < ops.index("commit")
    assert final.commit_step == 32 and final.phase == "done"


def test_a_restarted_executor_resends_the_recorded_switch_step() -> None:
    plan = drain_plan()
    h = harness(plan, passed=11)  # not yet past the recorded k
    final = h.run(MigrationRecord(plan=plan, phase="committing", commit_step=12))
    assert "status" not in [op for op, _ in h.sidecars.ops()]
    assert "prepare" not in [op for op, _ in h.sidecars.ops()]
    assert final.commit_step == 12 and final.phase == "done"


def test_a_commit_round_refused_as_too_late_goes_again_with_a_later_recorded_k() -> None:
    plan = drain_plan()
    h = harness(plan)
    h.passed_while_saving = [5]  # k = 12 is written while the ranks pass step 15
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "done", final.error
    assert [r.commit_step for r in h.saved if r.phase == "committing"] == [None, 12, 19]
    assert final.commit_round == 1 and final.commit_step == 15 + 2 * 2
    commits = [(c.machine, int(c.args["step"])) for c in h.sidecars.sent if c.op == "commit"]
    assert {k for _, k in commits} == {12, 19}
    assert {m for m, k in commits if k == 19} == set(plan.affected_machines())


def test_commit_rounds_are_bounded() -> None:
    plan = drain_plan()
    h = harness(plan)
    h.passed_while_saving = [100] * COMMIT_ROUNDS  # every write outlasts the margin
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "failed"
    assert final.error is not None and "too late" in final.error
    assert len({int(c.args["step"]) for c in h.sidecars.sent if c.op == "commit"}) == COMMIT_ROUNDS


def test_a_refused_command_fails_the_migration_and_aborts_the_joiner() -> None:
    plan = drain_plan()
    h = harness(plan, refuse={("transfer", "m1")})
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "failed"
    assert final.error is not None
    assert final.error.startswith("transferring: MigrationFailed: transfer on m1: no such plan")
    # After the switch: only the joiner is told (it is relaunched as a standby).
    assert h.sidecars.machines("abort") == ["s0"]
    assert "release" not in [op for op, _ in h.sidecars.ops()]
    assert h.states()[-1] == "failed"
    assert h.saved[-1].phase == "failed"
    assert h.settled == []  # nobody died: nothing for the planner to act on


def test_a_failed_phase_ends_the_sends_still_waiting_for_an_answer() -> None:
    """m1 refuses its prepare while the joiner s0 has not answered yet: the migration
    fails at once, and the prepare to s0 is no longer sent (a machine relaunched
    meanwhile would take it for its own)."""
    plan = drain_plan()
    h = harness(plan, refuse={("prepare", "m1")}, silent={("prepare", "s0")})
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "failed"
    assert final.error is not None and "prepare on m1: no such plan" in final.error
    assert h.sidecars.cancelled == [("prepare", "s0")]


def test_a_leaver_whose_worker_died_is_left_to_the_planner_before_the_migration_fails() -> None:
    plan = drain_plan()
    h = harness(plan, refuse={("transfer", "m1")}, error="WorkerDied: m1/0 exited with -9")
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "failed" and final.error is not None and "WorkerDied" in final.error
    assert [machine for machine, _ in h.settled] == ["m1"]
    assert "failed" not in h.settled[0][1]  # settled before the failure was published
    assert h.states()[-1] == "failed"


@pytest.mark.parametrize(
    ("refuse", "end"), [(set(), "done"), ({("prepare", "m1")}, "retrying")], ids=["done", "failed"]
)
def test_an_end_the_bus_refused_is_published_when_the_migration_runs_again(refuse, end) -> None:
    plan = drain_plan()
    h = harness(plan, refuse=refuse)
    h.lost_publish = {end}
    migration = h.migration(MigrationRecord(plan=plan))
    with pytest.raises(NatsTimeout):
        asyncio.run(migration.run())
    sent = list(h.sidecars.sent)
    assert end not in h.states()
    final = asyncio.run(migration.run())
    assert h.states()[-1] == end and h.states().count(end) == 1
    assert final.phase == ("done" if end == "done" else "failed")
    assert h.saved[-1].phase == final.phase
    assert h.sidecars.sent == sent  # nothing sent again: only the end was missing


def test_a_write_the_bus_refused_after_the_switch_does_not_fail_the_migration() -> None:
    plan = drain_plan()
    h = harness(plan)
    h.lost_publish = {"releasing"}
    migration = h.migration(MigrationRecord(plan=plan))
    with pytest.raises(NatsTimeout):
        asyncio.run(migration.run())
    final = asyncio.run(migration.run())
    assert final.phase == "done" and final.error is None
    # The joiner holds its role: it is never told to give it back.
    assert "abort" not in [op for op, _ in h.sidecars.ops()]
    assert h.states() == ["phase1", "committing", "transferring", "releasing", "done"]


# -- a failure ---------------------------------------------------------------------------


def test_a_phase1_failure_tells_the_leaver_it_trains_on() -> None:
    plan = drain_plan()
    h = harness(plan, refuse={("prepare", "m1")})
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "failed" and final.error is not None
    assert final.error.startswith("phase1: MigrationFailed: prepare on m1")
    # Before the switch the leaver m0 still holds its role: its sidecar stops saying
    # "leaving"; the joiner s0 is relaunched as a standby.
    assert sorted(h.sidecars.machines("abort")) == ["m0", "s0"]
    # The leaver trains on, so the planner plans the drain again: not the drain's end.
    assert plan.retries_left > 0 and h.states()[-1] == "retrying"


def test_a_phase1_failure_with_no_try_left_ends_the_drain() -> None:
    plan = drain_plan().model_copy(update={"retries_left": 0})
    h = harness(plan, refuse={("prepare", "m1")})
    assert h.run(MigrationRecord(plan=plan)).phase == "failed"
    assert h.states()[-1] == "failed"


def test_recovery_sends_recover_to_survivors_and_joiner_then_ends_without_release() -> None:
    plan = failure_plan()
    assert plan.migration != "planned"
    h = harness(plan)
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "done", final.error
    assert h.states() == ["recovering", "transferring", "done"]
    expected = ["m1", "m2", "m3", *sorted(plan.joiners())]  # m0 is the dead leaver
    assert final.results["machines"]["recovery"] == expected
    assert sorted(h.sidecars.machines("recover")) == sorted(expected)
    assert sorted(h.sidecars.machines("transfer")) == sorted(expected)
    assert "release" not in [op for op, _ in h.sidecars.ops()]
    assert "abort" not in [op for op, _ in h.sidecars.ops()]
    assert final.commit_step == 12  # every rank resumed after step 12


def test_recovery_machines_are_recorded_before_recover_goes_out() -> None:
    plan = failure_plan()
    h = harness(plan)
    h.run(MigrationRecord(plan=plan))
    assert h.saved[0].results["machines"]["recovery"] == ["m1", "m2", "m3", "s0"]
    assert "recover" not in h.saved[0].results


def test_a_restarted_recovery_sends_to_the_recorded_machines() -> None:
    plan = failure_plan()
    h = harness(plan)
    h.survivors = ["m1"]  # the survivors changed since: the record wins
    record = MigrationRecord(
        plan=plan, phase="recovering", results={"machines": {"recovery": ["m1", "m2", "s0"]}}
    )
    final = h.run(record)
    assert h.asked_survivors == 0
    assert sorted(h.sidecars.machines("recover")) == ["m1", "m2", "s0"]
    assert final.phase == "done"


def test_a_failed_recovery_sends_no_abort() -> None:
    plan = failure_plan()
    h = harness(plan, refuse={("recover", "m2")})
    final = h.run(MigrationRecord(plan=plan))
    assert final.phase == "failed"
    assert final.error is not None and "recover on m2" in final.error
    assert "abort" not in [op for op, _ in h.sidecars.ops()]


def test_progress_goes_to_every_merged_event_too() -> None:
    plan = drain_plan().model_copy(update={"merged_events": {"e-old": "p-old"}})
    h = harness(plan)
    h.run(MigrationRecord(plan=plan))
    done = [p.event_id for p in h.published if p.state == "done"]
    assert sorted(done) == sorted([plan.event_id, "e-old"])
