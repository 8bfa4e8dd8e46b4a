"""A standby's sidecar keeps waiting for workers that are alive but slow to start, and
offers the machine as warm once they are, instead of leaving it cold for good."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from tests.conftest import register_job, sample_state
from trainmover.messages import Heartbeat, decode
from trainmover.runtime.config import JobConfig
from trainmover.services.sidecar.service import Sidecar, SidecarSettings
from trainmover.subjects import JobSubjects

WAIT_S = 300.0


async def test_workers_slower_than_the_command_timeout_still_warm_up(
    nc: NatsClient, nats_url: str, job: str, tmp_path
) -> None:
    await register_job(nc, job, sample_state(job, standbys=0))
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
        run_dir=tmp_path,
        entry="tests.sidecar.slow_worker",
        heartbeat_interval_s=0.2,
        command_timeout_s=2.0,  # the workers' hello comes later than this
    )
    sidecar = Sidecar(settings)
    await sidecar.start()
    try:
        await asyncio.wait_for(warm.wait(), WAIT_S)
    finally:
        await sidecar.stop()
