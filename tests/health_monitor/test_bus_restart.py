"""A nats-server restart longer than the heartbeat timeout fails no machine.

While the monitor is off the bus it hears nobody; that silence is its own. Found by the
chaos soak: a restart of ~3 s failed every machine of the job at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.conftest import register_job
from trainmover import bus
from trainmover.messages import FailureEvent
from trainmover.natsserver import EmbeddedNats
from trainmover.services.health_monitor.config import load
from trainmover.services.health_monitor.service import HealthMonitor

from .conftest import FAST, WAIT, Heartbeats, events_of, is_event

TIMEOUT_S = 0.05 * 20  # FAST: interval x intervals


async def test_no_failure_for_a_bus_outage(tmp_path: Path, job: str) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await bus.connect(server.url, "test")
    argv = ["--nats-url", server.url, "--job", job, "--http-host", "127.0.0.1"]
    monitor = HealthMonitor(load([*argv, "--http-port", "0", *FAST], env={}))
    beats = Heartbeats(nc, job, {"m0", "m1", "m2", "m3", "s0"})
    try:
        await register_job(nc, job)
        await monitor.start()
        await monitor.wait_loaded(WAIT)
        beats.start()
        events = await events_of(nc, job)
        await beats.beat_once()
        server.stop(kill=True)
        # The fault itself: an outage three heartbeat timeouts long.
        await asyncio.sleep(3 * TIMEOUT_S)
        server.start()
        # Control: m3 really goes silent after the restart; its failure must come...
        beats.alive.discard("m3")
        await events.wait_for(is_event("m3"), WAIT)
        # ...and it is the only one.
        failed = {e.machine for e in events.items if isinstance(e, FailureEvent)}
        assert failed == {"m3"}
    finally:
        await beats.stop()
        await monitor.stop()
        await nc.close()
        server.cleanup()
