"""A standby's sidecar keeps waiting for workers that are alive but slow to start, tries
again a warm-up that failed, and offers the machine as warm once it is, instead of
leaving it cold for good."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from tests.conftest import register_job, sample_state
from trainmover.messages import Heartbeat, decode
from trainmover.runtime.config import JobConfig
from trainmover.services.sidecar.service import Sidecar, SidecarSettings
from trainmover.subjects import JobSubjects

WAIT_S = 300.0


async def _warms_up(nc: NatsClient, nats_url: str, job: str, run_dir: Path, entry: str) -> None:
    """A standby s0 running `entry` comes to offer itself warm (the wait fails if not)."""
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
        run_dir=run_dir,
        entry=entry,
        heartbeat_interval_s=0.2,
        command_timeout_s=2.0,  # the slow workers' hello comes later than this
    )
    sidecar = Sidecar(settings)
    await sidecar.start()
    try:
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
