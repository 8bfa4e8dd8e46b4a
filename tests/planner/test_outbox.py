"""A decision whose outputs could not be sent (the bus went away as the planner published
its plan) is sent later from the stored outbox: when its input is redelivered and turns
out already decided, or by the planner's own retry when no input comes at all."""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import NoStreamResponseError

from tests.conftest import register_job, sample_state
from trainmover.bus.clusterstate import follow_states
from trainmover.client import TrainMoverClient
from trainmover.messages import ClusterState, Plan, decode
from trainmover.runtime.config import JobConfig
from trainmover.services.planner.service import PlannerService
from trainmover.subjects import JobSubjects


async def _stored_with_empty_outbox(nc: NatsClient, job: str) -> ClusterState:
    kv = await nc.jetstream().key_value(JobSubjects(job).bucket)
    async for state in follow_states(kv):
        if not state.outbox:
            return state
    raise AssertionError("follow ended")


async def test_a_plan_that_failed_to_publish_goes_out_once_the_bus_answers(
    nc: NatsClient, job: str
) -> None:
    await register_job(nc, job, sample_state(job))
    subjects = JobSubjects(job)
    plans: asyncio.Queue[Plan] = asyncio.Queue()

    async def on_plan(msg: Msg) -> None:
        plans.put_nowait(decode(Plan, msg.data))

    sub = await nc.subscribe(subjects.plans, cb=on_plan)
    service = PlannerService(nc, JobConfig(job=job))
    real_publish = service._js.publish
    refusals = []

    async def publish(subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        # The plans stream does not answer the decision's publish nor the one of the
        # resync after it; it does from then on.
        if subject == subjects.plans and len(refusals) < 2:
            refusals.append(subject)
            raise NoStreamResponseError
        return await real_publish(subject, payload, **kwargs)

    service._js.publish = publish  # type: ignore[method-assign]
    await service.start()
    try:
        event_id = await TrainMoverClient(nc).drain(job, "m1", reason="outbox")
        plan = await asyncio.wait_for(plans.get(), 30)
        assert plan.event_id == event_id and len(refusals) == 2
        # ... and the stored state says so: nothing left to send, the drain decided.
        stored = await asyncio.wait_for(_stored_with_empty_outbox(nc, job), 30)
        assert event_id in stored.handled
    finally:
        await service.stop()
        await sub.unsubscribe()
