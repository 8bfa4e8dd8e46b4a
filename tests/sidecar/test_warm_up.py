"""A standby's sidecar keeps waiting for workers that are alive but slow to start, tries
again a warm-up that failed, and offers the machine as warm once it is, instead of
leaving it cold for good; until then it takes no role."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from tests.conftest import register_job, sample_state
from trainmover import bus
from trainmover.messages import Command, DrainEvent, FailureEvent, Heartbeat, decode
from trainmover.planwire import plan_args
from trainmover.runtime.config import JobConfig
from trainmover.services.planner.decisions import Planner
from trainmover.services.sidecar.service import Sidecar, SidecarSettings
from trainmover.subjects import JobSubjects

WAIT_S = 300.0


async def _warms_up(
    nc: NatsClient,
    nats_url: str,
    job: str,
    run_dir: Path,
    entry: str,
    before_warm: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """A standby s0 running `entry` comes to offer itself warm (the wait fails if not);
    `before_warm` runs once its sidecar started."""
    await register_job(nc, job, sample_state(job))
    warm = asyncio.Event()

    async def on_beat(msg: Msg) -> None:
        if decode(Heartbeat, msg.data).warm_role_types:
            warm.set()

    await nc.subscribe(JobSubjects(job).heartbeat("s0"), cb=on_beat)
    settings = SidecarSettings(
        nats_url=nats_url,
        config=JobConfig(job=job),
        machine="s0",
        rendezvous="127.0.0.1:1",  # a standby never dials the store before it joins
        run_dir=run_dir,
        entry=entry,
        heartbeat_interval_s=0.2,
        command_timeout_s=2.0,  # the slow workers' hello comes later than this
    )
    sidecar = Sidecar(settings)
    await sidecar.start()
    try:
        if before_warm is not None:
            await before_warm()
        await asyncio.wait_for(warm.wait(), WAIT_S)
    finally:
        await sidecar.stop()


async def test_workers_slower_than_the_command_timeout_still_warm_up(
    nc: NatsClient, nats_url: str, job: str, tmp_path: Path
) -> None:
    await _warms_up(nc, nats_url, job, tmp_path, "tests.sidecar.slow_worker")


async def test_a_warm_up_that_failed_is_tried_again(
    nc: NatsClient, nats_url: str, job: str, tmp_path: Path
) -> None:
    """Every worker's first warm-up fails (its recordings unreadable); the standby warms
    up on a later try."""
    await _warms_up(nc, nats_url, job, tmp_path, "tests.sidecar.flaky_warm_worker")
    failed = (tmp_path / "warm_failures").read_text().split()
    assert len(failed) == len(set(failed)) >= 1  # each worker failed once


async def test_a_standby_not_warm_yet_refuses_a_role(
    nc: NatsClient, nats_url: str, job: str, tmp_path: Path
) -> None:
    """The job's state still lists s0 as a warm standby (an earlier launch of it): a
    prepare (drain) or recover (failure) making it a joiner, sent before its new workers
    warmed up, is refused."""
    plans = {}
    for op, event in (("prepare", DrainEvent), ("recover", FailureEvent)):
        out = Planner().on_event(sample_state(job), event(job=job, machine="m0"), time.time())
        (plans[op],) = out.plans
        assert plans[op].joiners() == {"s0"}

    async def prepare() -> None:
        for op, plan in plans.items():
            command = Command(
                job=job,
                machine="s0",
                op=op,
                plan_id=plan.plan_id,
                args={**plan_args(plan), "timeout_s": 5.0},
            )
            reply = await bus.request(nc, command, timeout=10.0)
            assert not reply.ok, op
            assert reply.error is not None and "not warm" in reply.error, reply.error

    await _warms_up(nc, nats_url, job, tmp_path, "tests.sidecar.slow_worker", prepare)
