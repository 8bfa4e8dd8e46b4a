"""Shared fixtures: a real embedded nats-server per test session, a fresh job per test.

`make test` (and `make test-long`, the tests marked long) runs the suite as parallel
pytest-xdist streams (`--dist loadgroup`): tests that share an expensive session or
module fixture (a reference run, a bus cluster) are put in one group, so that one stream
builds it once.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from trainmover import bus
from trainmover.bus.clusterstate import StateStore
from trainmover.messages import ClusterState, MachineState, new_id
from trainmover.natsserver import EmbeddedNats
from trainmover.runtime.layout import Layout

os.environ.setdefault("OMP_NUM_THREADS", "1")

#: Shared fixtures cheap enough for every stream to build its own (the e2e references
#: run lazily, to the step a test asks for).
_PER_STREAM = frozenset({"nats_server", "tmp_path_factory", "event_loop_policy", "references"})


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The expensive shared fixtures a test uses, by name (a module's own by module too)."""
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:
        return []
    names = []
    for name, defs in definitions.name2fixturedefs.items():
        scope = defs[-1].scope
        if name in _PER_STREAM or scope not in ("session", "module"):
            continue
        if scope == "module":
            names.append(f"{item.module.__name__}:{name}")
        else:
            names.append(name)
    return names


def _timeout(item: pytest.Item) -> float:
    """The test's own time limit (pytest-timeout's marker), the suite's for one without:
    a long limit is how a test says it is long."""
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker and marker.args else 0.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests joined by a shared fixture, directly or through others, form one group; the
    modules with the longest tests come first (make test keeps this order, --no-loadscope-reorder), so
    that no stream is left with a long test at the end."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    uses = [(item, _shared_fixtures(item)) for item in items]
    for _, names in uses:
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    longest: dict[Path, float] = {}
    for item, names in uses:
        if names:
            item.add_marker(pytest.mark.xdist_group(root(names[0])))
        longest[item.path] = max(longest.get(item.path, 0.0), _timeout(item))
    # By module, so that a module's tests stay together (its module fixtures built once).
    items.sort(key=lambda item: -longest[item.path])


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
    """Creates the job's bus resources and writes its cluster state, as the planner does
    (on a cluster, the new bucket's stream may still be electing its leader)."""
    kv = await bus.ensure_job(nc.jetstream(), job)
    store = StateStore(kv)

    async def write() -> int:
        stored = await store.read()  # a job registered again is overwritten
        last = None if stored is None else stored.revision
        return await store.write(state or sample_state(job), last)

    await bus.through_failover(write, f"cluster state of {job}")
