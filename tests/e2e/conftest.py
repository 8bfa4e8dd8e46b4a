"""End-to-end fixtures: the whole system as separate processes on loopback.

`cluster` is a `LocalCluster` (the stack of `trainmover up`: embedded nats-server,
planner, executor, health-monitor, one sidecar per machine with real worker processes)
for a TP2 x PP2 x DP2 job on 4 machines of 2 ranks plus 2 standbys (`config`; a test
may choose another). A test ends its job soon after its last fault
(`cluster.finish_soon`) and compares with `reference(step)`: the same training run
without any migration, to that step, for the bit-exact check.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from trainmover.localcluster import LocalCluster
from trainmover.localjob import LocalJob
from trainmover.messages import FailureEvent, MigrationProgress
from trainmover.runtime.compare import state_files
from trainmover.runtime.config import JobConfig

STEPS = 150
#: Generous bound on any one wait: the 2 shared cores are sometimes heavily loaded.
WAIT_S = 300.0

CONFIG = JobConfig(job="e2e").with_updates(
    train={"steps": STEPS, "dump_steps": [STEPS]},
    runtime={"group_timeout_s": 60},
    cluster={"standbys": ["s0", "s1"], "maintenance_s": 1.0},
)

#: A longer job with three standbys and no return from maintenance, for tests that make
#: several migrations in a row. (Each test ends its job soon after its last fault: the
#: lengths here are upper bounds.)
LONG_STEPS = 400
LONG = CONFIG.with_updates(
    train={"steps": LONG_STEPS, "dump_steps": [LONG_STEPS]},
    cluster={"standbys": ["s0", "s1", "s2"], "maintenance_s": 3600.0},
)

#: The same jobs with one rank per machine (no tensor parallelism), half the processes:
#: for tests whose subject is the control plane (the bus, auth, fencing, durability),
#: not the layout. The migrations of the 3-D layout are tested on CONFIG and LONG. A
#: step of one rank per machine takes a quarter of the time or less: more steps keep the
#: job training for as long as the test's faults need (the long job's tests make theirs
#: early; twice the steps leave them a margin).
TP1 = CONFIG.with_updates(layout={"tp": 1}, train={"steps": 4 * STEPS, "dump_steps": [4 * STEPS]})
TP1_LONG = LONG.with_updates(
    layout={"tp": 1}, train={"steps": 2 * LONG_STEPS, "dump_steps": [2 * LONG_STEPS]}
)
#: For a test that slows every machine down per step itself (the bus cluster's).
TP1_SLOWED = LONG.with_updates(layout={"tp": 1})


def _training(config: JobConfig) -> str:
    """What decides a job's trained state: everything but its length, its dumps and its
    cluster (standbys, maintenance); a run of N steps is a prefix of a longer one."""
    return config.with_updates(
        train={"steps": 1, "dump_steps": [], "dump_every": 0},
        cluster={"standbys": [], "maintenance_s": 0.0},
    ).model_dump_json()


Reference = Callable[[int], Awaitable[dict[str, Path]]]
"""The uninterrupted run's saved states by role after a step (`reference(step)`)."""


@pytest.fixture(scope="session")
def references(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[JobConfig, int], dict[str, Path]]:
    """Uninterrupted runs' states by role after a step: one run per distinct training and
    step, to that step only. A test ends its job soon after its last fault
    (`LocalCluster.finish_soon`) and asks for the reference of that step afterwards."""
    runs: dict[tuple[str, int], Path] = {}
    lock = threading.Lock()

    def reference_for(config: JobConfig, step: int) -> dict[str, Path]:
        key = (_training(config), step)
        with lock:
            if key not in runs:
                run_dir = tmp_path_factory.mktemp("reference")
                run = config.with_updates(train={"steps": step, "dump_steps": [step]})
                with LocalJob.launch(run, run_dir, standbys=0, timeout_s=WAIT_S) as job:
                    job.finish(WAIT_S)
                runs[key] = run_dir
        return state_files(runs[key], step)

    return reference_for


@pytest.fixture
def reference(
    references: Callable[[JobConfig, int], dict[str, Path]], config: JobConfig
) -> Reference:
    """The uninterrupted run of the test's job config (`config`) after a step, run in a
    thread (it takes a while; the cluster's bus client keeps being served meanwhile)."""

    async def after(step: int) -> dict[str, Path]:
        return await asyncio.to_thread(references, config, step)

    return after


@pytest.fixture
def config() -> JobConfig:
    """The job the `cluster` runs; a test overrides it with `parametrize("config", ...)`."""
    return CONFIG


@pytest.fixture
async def cluster(tmp_path: Path, config: JobConfig) -> AsyncIterator[LocalCluster]:
    async with LocalCluster(config, tmp_path) as running:
        yield running


async def next_progress(
    items: AsyncIterator[object], event_id: str, state: str
) -> MigrationProgress:
    """The next progress of `event_id` in `state` on an open watch."""
    async for item in items:
        if isinstance(item, MigrationProgress) and (item.event_id, item.state) == (event_id, state):
            return item
    raise AssertionError("watch ended")


async def progress_reaches(cluster: LocalCluster, event_id: str, state: str) -> MigrationProgress:
    """The progress of `event_id` in `state`, from the start of the job's history."""
    async with cluster.client.watch(cluster.job, from_start=True) as items:
        return await next_progress(items, event_id, state)


@contextlib.asynccontextmanager
async def failures_of(cluster: LocalCluster) -> AsyncIterator[list[FailureEvent]]:
    """The job's failure events while inside, as they come."""
    failures: list[FailureEvent] = []
    async with cluster.client.watch(cluster.job) as items:

        async def collect() -> None:
            async for item in items:
                if isinstance(item, FailureEvent):
                    failures.append(item)

        collector = asyncio.create_task(collect())
        try:
            yield failures
        finally:
            collector.cancel()
