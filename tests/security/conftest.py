"""A real nats-server running the generated least-privilege config, and connections as
each component (credentials files written by `trainmover.security`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from tests.conftest import register_job
from trainmover import bus
from trainmover.localcluster import LocalCluster
from trainmover.natsserver import EmbeddedNats
from trainmover.runtime.config import JobConfig
from trainmover.security import credentials
from trainmover.security.authcli import generate
from trainmover.security.policy import Component
from trainmover.security.secrets import AuthStore

JOB_A = "jobA"
JOB_B = "jobB"
JOBS = {JOB_A: ["m0", "m1", "m2", "m3", "s0"], JOB_B: ["m0", "m1", "m2", "m3", "s0"]}
FAST_BCRYPT = 4
"""bcrypt's minimum cost: the server checks a hash on every connect."""


@dataclass
class SecureBus:
    server: EmbeddedNats
    store: AuthStore

    @property
    def url(self) -> str:
        return self.server.url

    def creds(self, name: str) -> Path:
        return self.store.creds_file(name)

    def auth(self, name: str) -> credentials.NatsAuth:
        return credentials.from_file(self.creds(name))

    async def connect(self, name: str) -> NatsClient:
        return await bus.connect(self.url, name, auth=self.auth(name), max_reconnect_attempts=2)


@pytest.fixture(scope="session")
def secure_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBus]:
    root = tmp_path_factory.mktemp("secure-bus")
    store, _ = generate(root / "auth", JOBS, rounds=FAST_BCRYPT)
    # One sidecar of job B authenticates by NKey instead of a password.
    nkey_user = Component("sidecar", (JOB_B,), "s0")
    records = store.ensure([nkey_user], kind="nkey")
    from trainmover.security.authcli import write_server_files

    write_server_files(store, [*store.load().values()])
    assert records[0].kind == "nkey"
    server = EmbeddedNats(root / "js", config_file=store.root / "nats-server.conf").start()
    try:
        yield SecureBus(server, store)
    finally:
        server.cleanup()


Connect = Callable[[str], Awaitable[NatsClient]]


@pytest.fixture
async def connect_as(secure_bus: SecureBus) -> AsyncIterator[Connect]:
    """`await connect_as("client.jobA")`: a connection as that user, closed afterwards."""
    opened: list[NatsClient] = []

    async def connect(name: str) -> NatsClient:
        nc = await secure_bus.connect(name)
        opened.append(nc)
        return nc

    yield connect
    for nc in opened:
        if not nc.is_closed:
            await nc.close()


@pytest.fixture
async def registered(secure_bus: SecureBus) -> SecureBus:
    """Both jobs' streams and cluster states exist, written by the planner as in life."""
    planner = await secure_bus.connect("planner")
    try:
        for job in JOBS:
            await register_job(planner, job)
    finally:
        await planner.close()
    return secure_bus


@pytest.fixture
async def secure_cluster(tmp_path: Path, config: JobConfig) -> AsyncIterator[LocalCluster]:
    """The whole local cluster under `--auth` (every process on its own credentials),
    running `config` (a test parametrizes it)."""
    async with LocalCluster(config, tmp_path, auth=True, bcrypt_cost=FAST_BCRYPT) as running:
        yield running
