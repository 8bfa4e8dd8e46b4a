"""The executor service against a real nats-server: which stored migrations it runs.

No sidecars answer here, so a launched migration gets no further than its first progress
("phase1"); that is enough to tell which plans the executor started.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from tests.conftest import register_job, sample_state
from trainmover import bus
from trainmover.messages import (
    ClusterState,
    DrainEvent,
    MigrationProgress,
    Plan,
    decode,
)
from trainmover.services.executor.migration import MigrationRecord
from trainmover.services.executor.service import ExecutorService
from trainmover.services.planner.decisions import Planner
from trainmover.subjects import STATE_KEY, JobSubjects

pytestmark = pytest.mark.timeout(120)


def _plan(job: str, machine: str) -> tuple[Plan, ClusterState]:
    """A planned migration of `machine`, and the planner's state holding it in flight."""
    out = Planner().on_event(sample_state(job), DrainEvent(job=job, machine=machine), time.time())
    (plan,) = out.plans
    return plan, out.state


@pytest.fixture
async def executor(nc: NatsClient, job: str) -> AsyncIterator[ExecutorService]:
    service = ExecutorService(nc, job, timeout_s=5.0)
    yield service
    await service.stop()


async def _watch_starts(nc: NatsClient, job: str) -> Subscription:
    sub = await nc.subscribe(JobSubjects(job).progress)
    await nc.flush()  # subscribed at the server before anything is published
    return sub


async def _first_start(sub: Subscription) -> str:
    """The plan id of the next migration to start (its "phase1" progress)."""
    async for msg in sub.messages:
        progress = decode(MigrationProgress, msg.data)
        if progress.state == "phase1":
            return progress.plan_id
    raise AssertionError("subscription ended")


async def _store(nc: NatsClient, job: str, record: MigrationRecord) -> None:
    kv = await nc.jetstream().key_value(JobSubjects(job).executor_bucket)
    await kv.put(f"migration.{record.plan.plan_id}", record.to_json())


async def test_a_plan_redelivered_after_its_record_was_stored_is_run(nc, job, executor) -> None:
    plan, state = _plan(job, "m0")
    await register_job(nc, job, state)
    await executor.start()
    # The executor stored the record, then the ack failed (the server went away):
    # the plan comes again and nothing has launched it yet.
    await _store(nc, job, MigrationRecord(plan=plan))
    starts = await _watch_starts(nc, job)
    await nc.jetstream().publish(JobSubjects(job).plans, plan.to_json())
    assert await asyncio.wait_for(_first_start(starts), 30) == plan.plan_id
    assert plan.plan_id in executor.running


async def test_a_plan_redelivered_after_its_migration_ended_is_not_run_again(
    nc, job, executor
) -> None:
    ended, _ = _plan(job, "m0")
    fresh, state = _plan(job, "m1")
    await register_job(nc, job, state)
    await executor.start()
    await _store(nc, job, MigrationRecord(plan=ended, phase="done"))
    starts = await _watch_starts(nc, job)
    # One consumer takes plans in order: once the fresh plan started, the ended one was
    # already handled.
    await nc.jetstream().publish(JobSubjects(job).plans, ended.to_json())
    await nc.jetstream().publish(JobSubjects(job).plans, fresh.to_json())
    assert await asyncio.wait_for(_first_start(starts), 30) == fresh.plan_id
    assert executor.running == {fresh.plan_id}


async def test_a_death_heard_first_is_left_to_the_planner_until_it_withdraws_the_plan(
    nc, job, executor
) -> None:
    """A migration told of its leaver's death (a `WorkerDied` reply) waits for the
    planner; once the planner's state no longer holds its plan (a recovery took it over)
    it never goes on to report the plan failed: the withdrawal cancels it."""
    plan, state = _plan(job, "m0")
    await register_job(nc, job, state)
    executor.failure_grace_s = 60.0
    await executor.start()
    settling = asyncio.create_task(executor._settle(plan.plan_id, "m0"))
    withdrawn = state.model_copy(update={"in_flight": {}})
    kv = await bus.job_bucket(nc.jetstream(), job)
    await kv.put(STATE_KEY, withdrawn.to_json())

    def seen() -> bool:
        return executor._last_state is not None and not executor._last_state.in_flight

    async with executor._state_changed:
        await asyncio.wait_for(executor._state_changed.wait_for(seen), 30)
    done, _ = await asyncio.wait({settling}, timeout=1.0)
    assert not done  # held for the withdrawal's cancel, not returning to fail the plan
    settling.cancel()


async def test_a_death_no_recovery_follows_fails_after_the_grace(nc, job, executor) -> None:
    plan, state = _plan(job, "m0")
    await register_job(nc, job, state)
    executor.failure_grace_s = 0.5
    await executor.start()
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(executor._settle(plan.plan_id, "m0"), 30)
    # It gave up on a declaration that never came, the plan still in flight.
    assert [e["event"] for e in logs if e["event"] == "failure_not_declared"] == [
        "failure_not_declared"
    ]
