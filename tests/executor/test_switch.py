"""The switch step: picking k, judging a commit round, and a migration whose first
commit(k) came too late (its record write waited while the ranks trained on)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from tests.conftest import sample_state
from trainmover.messages import (
    Command,
    CommandReply,
    DrainEvent,
    MigrationProgress,
    Plan,
    decode,
)
from trainmover.services.executor.migration import Migration, MigrationRecord
from trainmover.services.executor.switch import (
    COMMIT_ROUNDS,
    TOO_LATE,
    judge_commit,
    switch_step,
)
from trainmover.services.planner.decisions import Planner
from trainmover.subjects import JobSubjects

pytestmark = pytest.mark.timeout(60)


def test_switch_step_is_margin_past_the_furthest_rank_doubling_per_round() -> None:
    assert switch_step([7, 9, 8], margin=2) == 11
    assert switch_step([9], margin=2, round_=1) == 13
    assert switch_step([9], margin=3, round_=2) == 21


@pytest.mark.parametrize(("passed", "margin"), [([], 2), ([4], 0)])
def test_switch_step_refuses_what_it_cannot_pick_from(passed: list[int], margin: int) -> None:
    with pytest.raises(ValueError, match="step"):
        switch_step(passed, margin)


def _answer(accepted: int, passed: int, **refused: str) -> dict[str, object]:
    return {"accepted": accepted, "refused": refused, "passed": passed}


def test_a_round_every_rank_took_is_accepted() -> None:
    outcome = judge_commit({"m0": _answer(2, 5), "s0": _answer(2, 0)}, joiners=["s0"])
    assert (outcome.verdict, outcome.passed) == ("accepted", 5)


def test_a_round_every_non_joiner_refused_as_too_late_goes_again_from_the_furthest() -> None:
    answers = {
        "m0": _answer(0, 12, **{"m0/0": TOO_LATE, "m0/1": TOO_LATE}),
        "m1": _answer(0, 13, **{"m1/0": TOO_LATE, "m1/1": TOO_LATE}),
        "s0": _answer(2, 0),  # the joiner takes any k
    }
    outcome = judge_commit(answers, joiners=["s0"])
    assert (outcome.verdict, outcome.passed) == ("again", 13)


def test_a_round_that_split_the_ranks_goes_again_naming_who_took_k() -> None:
    # The ranks that took k drop it themselves (the switch agreement), so a later k is safe.
    answers = {
        "m0": _answer(2, 11),
        "m1": _answer(0, 12, **{"m1/0": TOO_LATE, "m1/1": TOO_LATE}),
    }
    outcome = judge_commit(answers, joiners=[])
    assert (outcome.verdict, outcome.passed) == ("again", 12)
    assert "m0 took k" in outcome.detail and "m1/0: too late" in outcome.detail


def test_a_refusal_other_than_too_late_fails() -> None:
    outcome = judge_commit({"m0": _answer(1, 3, **{"m0/1": "not ready"})}, joiners=[])
    assert outcome.verdict == "failed"
    assert "m0/1: not ready" in outcome.detail


# --- a migration's commit rounds against sidecars answering on a real bus ---------------


@dataclass
class Ranks:
    """The affected machines' sidecars as the executor sees them: every rank trains on
    (each boundary it passes is one more step) and refuses a commit(k) it has passed."""

    joiners: set[str]
    passed: int = 10
    commits: list[tuple[str, int]] = field(default_factory=list)

    def answer(self, command: Command) -> CommandReply:
        if command.op == "status":
            return CommandReply(
                command_id=command.command_id, ok=True, result={"step": self.passed}
            )
        if command.op == "commit":
            k = int(command.args["step"])
            self.commits.append((command.machine, k))
            ranks = [f"{command.machine}/{r}" for r in (0, 1)]
            if command.machine in self.joiners or k > self.passed:
                result = {"accepted": 2, "refused": {}, "passed": self.passed}
            else:
                result = {"accepted": 0, "refused": dict.fromkeys(ranks, TOO_LATE)}
                result["passed"] = self.passed
            return CommandReply(command_id=command.command_id, ok=True, result=result)
        return CommandReply(command_id=command.command_id, ok=False, error="not in this test")


@contextlib.asynccontextmanager
async def _answering(nc: NatsClient, job: str, ranks: Ranks) -> AsyncIterator[None]:
    async def on_command(msg: Msg) -> None:
        await msg.respond(ranks.answer(decode(Command, msg.data)).to_json())

    sub = await nc.subscribe(JobSubjects(job).commands, cb=on_command)
    await nc.flush()
    try:
        yield
    finally:
        await sub.unsubscribe()


def _plan(job: str) -> Plan:
    out = Planner().on_event(sample_state(job), DrainEvent(job=job, machine="m0"), time.time())
    (plan,) = out.plans
    return plan


async def _commit_rounds(
    nc: NatsClient, job: str, steps_per_write: list[int]
) -> tuple[MigrationRecord, Ranks, list[int]]:
    """Runs a plan from `committing`; the n-th record write lets the ranks pass
    `steps_per_write[n]` more steps (0 once the list is spent). Returns the final
    record, the ranks, and each recorded k."""
    plan = _plan(job)
    ranks = Ranks(joiners=set(plan.joiners()))
    recorded: list[int] = []

    async def save(record: MigrationRecord) -> None:
        if record.phase == "committing" and record.commit_step is not None:
            recorded.append(record.commit_step)
            ranks.passed += steps_per_write.pop(0) if steps_per_write else 0

    async def publish(progress: MigrationProgress) -> None:
        return None

    async def survivors() -> list[str]:
        return []

    record = MigrationRecord(plan=plan, phase="committing")
    migration = Migration(nc, record, save, publish, survivors, timeout_s=10.0, attempt_s=2.0)
    async with asyncio.timeout(30), _answering(nc, job, ranks):
        final = await migration.run()
    return final, ranks, recorded


async def test_a_commit_refused_as_too_late_is_sent_again_with_a_later_recorded_k(
    nc: NatsClient, job: str
) -> None:
    # The first record write of k=12 waits while the ranks pass step 15 (a leader
    # election): every rank refuses commit(12); k is picked again (15 + 2*2), recorded,
    # and taken. The migration goes on to the transfer (which these sidecars refuse).
    final, ranks, recorded = await _commit_rounds(nc, job, steps_per_write=[5])
    assert recorded == [12, 19]
    assert final.commit_step == 19 and final.commit_round == 1
    sent = sorted({k for _, k in ranks.commits})
    assert sent == [12, 19]
    assert {m for m, k in ranks.commits if k == 19} == set(final.plan.affected_machines())
    for k in (12, 19):  # each round reaches the joiner before any rank that could switch
        order = [m for m, sent_k in ranks.commits if sent_k == k]
        assert set(order[: len(ranks.joiners)]) == ranks.joiners, order
    assert final.error is not None and final.error.startswith("transferring:"), final.error


async def test_commit_rounds_are_bounded(nc: NatsClient, job: str) -> None:
    # Every write waits longer than the growing margin: the migration fails after
    # COMMIT_ROUNDS rounds, each one too late.
    final, _, recorded = await _commit_rounds(nc, job, steps_per_write=[100] * COMMIT_ROUNDS)
    assert len(recorded) == COMMIT_ROUNDS
    assert final.phase == "failed"
    assert final.error is not None and "too late" in final.error


def test_a_record_stored_before_phases_were_named_phase_resumes_in_its_phase() -> None:
    plan = _plan("j")
    stored = json.loads(MigrationRecord(plan=plan, phase="committing").to_json())
    stored["step"] = stored.pop("phase")
    record = decode(MigrationRecord, json.dumps(stored).encode())
    assert record.phase == "committing"
    assert record.plan == plan
