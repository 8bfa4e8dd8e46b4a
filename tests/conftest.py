"""Shared fixtures: a real embedded nats-server per test session, a fresh job per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.client import Client as NatsClient

from trainmover import bus
from trainmover.messages import ClusterState, MachineState, new_id
from trainmover.natsserver import EmbeddedNats
from trainmover.runtime.layout import Layout
from trainmover.subjects import STATE_KEY

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def job() -> str:
    return "job-" + new_id()[:10]


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await bus.connect(nats_url, "test")
    yield client
    await client.close()


def sample_state(job: str, machines: int = 4, standbys: int = 1) -> ClusterState:
    """A TP2 x PP2 x DP(machines/2) job on `machines` machines of 2 ranks, plus standbys."""
    layout = Layout(tp=2, pp=2, dp=max(1, machines // 2))
    state = {
        f"m{i}": MachineState(status="active", cell=cell)
        for i, cell in enumerate(layout.cells()[:machines])
    }
    for s in range(standbys):
        state[f"s{s}"] = MachineState(status="standby", warm_role_types=["first", "last"])
    return ClusterState(job=job, layout=layout, machines=state)


async def register_job(nc: NatsClient, job: str, state: ClusterState | None = None) -> None:
    """Creates the job's bus resources and writes its cluster state, as the planner does."""
    kv = await bus.ensure_job(nc.jetstream(), job)
    await kv.put(STATE_KEY, (state or sample_state(job)).to_json())
