"""End-to-end fixtures: the whole system as separate processes on loopback.

`cluster` starts `trainmover up`'s stack in-process (embedded nats-server, planner,
executor, health-monitor, one sidecar per machine with real worker processes) for a
TP2 x PP2 x DP2 job on 4 machines of 2 ranks plus standbys. `reference` is the same job
and seed run once per session without any migration, for the bit-exact comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from trainmover import bus
from trainmover.client import TrainMoverClient
from trainmover.messages import ClusterState, Heartbeat, StepStats, decode
from trainmover.runtime.compare import mismatches, state_files
from trainmover.runtime.config import JobConfig, save_config
from trainmover.runtime.driver import LocalJob
from trainmover.stack import Stack
from trainmover.subjects import STATE_KEY, JobSubjects

STEPS = 150
#: Generous bound on any one wait: the 2 shared cores are sometimes heavily loaded.
WAIT_S = 300.0

CONFIG = JobConfig(job="e2e").with_updates(
    train={"steps": STEPS, "dump_steps": [STEPS]},
    runtime={"group_timeout_s": 60},
    cluster={"standbys": ["s0", "s1"], "maintenance_s": 1.0},
)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted run's final states, by role."""
    run_dir = tmp_path_factory.mktemp("reference")
    with LocalJob(CONFIG, run_dir, standbys=0, timeout_s=WAIT_S) as job:
        job.wait_connected(WAIT_S)
        job.finish(WAIT_S)
    return state_files(run_dir, STEPS)


@dataclass
class Cluster:
    stack: Stack
    client: TrainMoverClient
    nc: NatsClient
    job: str
    steps: dict[str, int]
    stepped: asyncio.Condition

    async def wait_step(self, machine: str, step: int, timeout: float = WAIT_S) -> None:
        """Until `machine` reported a step >= `step` (its step statistics)."""
        async with self.stepped:
            await asyncio.wait_for(
                self.stepped.wait_for(lambda: self.steps.get(machine, -1) >= step), timeout
            )

    async def wait_state(
        self, predicate: Callable[[ClusterState], bool], timeout: float = WAIT_S
    ) -> ClusterState:
        """Until the planner's cluster state satisfies `predicate`; returns that state."""
        kv = await bus.job_bucket(self.nc.jetstream(), self.job)
        watcher = await kv.watch(STATE_KEY)

        async def reached() -> ClusterState:
            async for entry in watcher:
                if entry is not None and entry.value:
                    state = decode(ClusterState, entry.value)
                    if predicate(state):
                        return state
            raise AssertionError("state watch ended")

        try:
            return await asyncio.wait_for(reached(), timeout)
        finally:
            await watcher.stop()

    async def wait_finished(self, machines: list[str], timeout: float = WAIT_S) -> None:
        """Until every worker of `machines` exited cleanly (training ran to its end)."""
        finished: set[str] = set()
        done = asyncio.Event()

        async def on_beat(msg) -> None:
            beat = decode(Heartbeat, msg.data)
            if beat.workers and all(w.state == "exited" and w.exit_code == 0 for w in beat.workers):
                finished.add(beat.machine)
                if finished >= set(machines):
                    done.set()

        sub = await self.nc.subscribe(JobSubjects(self.job).heartbeats, cb=on_beat)
        try:
            await asyncio.wait_for(done.wait(), timeout)
        finally:
            await sub.unsubscribe()

    def final_mismatches(self, reference: dict[str, Path]) -> list[str]:
        return mismatches(state_files(self.stack.run_dir, STEPS), reference)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    config_path = save_config(CONFIG, tmp_path / "job.json")
    fast = ["--heartbeat-interval", "0.2"]
    stack = Stack(
        job_config=str(config_path),
        run_dir=tmp_path / "run",
        service_args={
            "sidecar": fast,
            "health-monitor": [*fast, "--heartbeat-timeout-intervals", "10"],
        },
    )
    async with stack:
        nc = await bus.connect(stack.url, "e2e-test")
        steps: dict[str, int] = {}
        stepped = asyncio.Condition()

        async def on_stats(msg) -> None:
            stats = decode(StepStats, msg.data)
            async with stepped:
                steps[stats.machine] = max(steps.get(stats.machine, -1), stats.step)
                stepped.notify_all()

        await nc.subscribe(JobSubjects(CONFIG.job).all_stats, cb=on_stats)
        client = TrainMoverClient(nc)
        try:
            yield Cluster(stack, client, nc, CONFIG.job, steps, stepped)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()


def dump(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))
