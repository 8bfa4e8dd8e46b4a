"""The embedded stack behind `trainmover up`: the bus, then every service, supervised.

Uses an existing NATS when given a URL, else starts the embedded nats-server. Each
service runs as its own process (`trainmover service NAME`), so they only ever talk over
the bus; a service that dies is restarted (each one resumes from the bus's durable
state). Services that this build does not have yet are left out.

With `auth`, the stack generates per-component credentials and a nats-server config
(trainmover.security) into `<store>/auth/`, runs the embedded server with it, and gives
each service its own credentials file (TRAINMOVER_NATS_CREDS) and
TRAINMOVER_NATS_REQUIRE_AUTH=1, so no service runs against an open bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import cast

from trainmover.logs import get_logger
from trainmover.natsserver import EmbeddedNats, resolve_url
from trainmover.security.credentials import CREDS_ENV, ENV
from trainmover.security.policy import Component, Role

AUTH_STANDBYS = 2
"""Standby sidecars (s0, s1, ...) that get credentials when machines are not named."""

log = get_logger("stack")

# Start order: consumers before producers, so nothing published at start is missed.
STACK_SERVICES = ("planner", "executor", "health-monitor")


def available_services() -> list[str]:
    """The services of STACK_SERVICES whose package provides `main` in this build."""
    found = []
    for name in STACK_SERVICES:
        module = importlib.import_module("trainmover.services." + name.replace("-", "_"))
        if hasattr(module, "main"):
            found.append(name)
    return found


class Stack:
    """Bus plus services as child processes; an async context manager."""

    def __init__(
        self,
        nats_url: str | None = None,
        store_dir: str | None = None,
        job_config: str | None = None,
        services: list[str] | None = None,
        auth: bool = False,
        auth_machines: list[str] | None = None,
        bcrypt_cost: int | None = None,
    ) -> None:
        self._given_url = resolve_url(nats_url)
        self._store_dir = store_dir
        self._job_config = job_config
        self._services = available_services() if services is None else services
        self._nats: EmbeddedNats | None = None
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self.url = ""
        self.auth = auth
        self._auth_machines = auth_machines
        self._bcrypt_cost = bcrypt_cost
        self._auth_tmp: str | None = None
        self.auth_dir: Path | None = None
        self.jobs: dict[str, list[str]] = {}
        if auth and self._given_url:
            raise ValueError(
                "--auth generates credentials for the embedded server; against an existing "
                "server give each service its own credentials (TRAINMOVER_NATS_CREDS)"
            )

    def creds_file(self, component: Component) -> Path:
        """The credentials file of `component` (with `auth`)."""
        if self.auth_dir is None:
            raise RuntimeError("the stack runs without --auth")
        from trainmover.security.secrets import AuthStore

        return AuthStore(self.auth_dir).creds_file(component)

    def creds_env(self, component: Component) -> dict[str, str]:
        """Environment for a child that connects as `component` (empty without auth)."""
        if self.auth_dir is None:
            return {}
        return {CREDS_ENV: str(self.creds_file(component)), ENV + "REQUIRE_AUTH": "1"}

    @property
    def operator_creds(self) -> Path | None:
        """Credentials for the person at the terminal: the job's client, else admin."""
        if self.auth_dir is None:
            return None
        if len(self.jobs) == 1:
            return self.creds_file(Component("client", (next(iter(self.jobs)),)))
        return self.creds_file(Component("admin"))

    def _auth_jobs(self) -> dict[str, list[str]]:
        if not self._job_config:
            return {}
        from trainmover.runtime.config import load_config

        config = load_config(self._job_config)
        machines = self._auth_machines
        if machines is None:
            machines = [f"m{i}" for i in range(config.layout.machines)]
            machines += [f"s{i}" for i in range(AUTH_STANDBYS)]
        return {config.job: machines}

    def _setup_auth(self) -> Path:
        from trainmover.security.authcli import generate
        from trainmover.security.secrets import BCRYPT_ROUNDS

        if self._store_dir:
            self.auth_dir = Path(self._store_dir) / "auth"
        else:
            self._auth_tmp = tempfile.mkdtemp(prefix="trainmover-auth-")
            self.auth_dir = Path(self._auth_tmp)
        self.jobs = self._auth_jobs()
        store, records = generate(
            self.auth_dir, self.jobs, rounds=self._bcrypt_cost or BCRYPT_ROUNDS
        )
        log.info("auth_generated", users=len(records), dir=str(store.root))
        return store.root / "nats-server.conf"

    @property
    def running(self) -> list[str]:
        return list(self._procs)

    async def __aenter__(self) -> Stack:
        if self._given_url:
            self.url = self._given_url
        else:
            config = await asyncio.to_thread(self._setup_auth) if self.auth else None
            server = EmbeddedNats(self._store_dir, config_file=config)
            self._nats = await asyncio.to_thread(server.start)
            self.url = self._nats.url
        log.info("bus_ready", url=self.url, embedded=self._nats is not None, auth=self.auth)
        for name in self._services:
            await self._spawn(name)
        return self

    def _service_args(self, name: str) -> list[str]:
        args = [sys.executable, "-m", "trainmover.cli", "--nats-url", self.url, "service", name]
        if self._job_config:
            args += ["--job-config", str(Path(self._job_config).resolve())]
        return args

    def _service_env(self, name: str) -> dict[str, str]:
        env = {**os.environ, "TRAINMOVER_NATS_URL": self.url}
        if self.auth:
            # Each service gets its own identity, never the operator's credentials.
            env = {k: v for k, v in env.items() if not k.startswith(ENV) or k == ENV + "URL"}
            role = cast(Role, name)  # STACK_SERVICES are roles of the policy
            env.update(self.creds_env(Component(role, tuple(sorted(self.jobs)))))
        return env

    async def _spawn(self, name: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self._service_args(name),
            stdin=asyncio.subprocess.DEVNULL,
            env=self._service_env(name),
        )
        self._procs[name] = proc
        log.info("service_started", service=name, pid=proc.pid)

    async def wait(self, stop: asyncio.Event) -> None:
        """Runs until `stop` is set, restarting any service that exits on its own."""
        while not stop.is_set():
            waits = {asyncio.create_task(p.wait()): n for n, p in self._procs.items()}
            stopper = asyncio.create_task(stop.wait())
            done, pending = await asyncio.wait(
                {stopper, *waits}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
            for task in done:
                if task in waits and not stop.is_set():
                    name = waits[task]
                    log.warning("service_exited", service=name, code=task.result())
                    await self._spawn(name)

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        for name, proc in reversed(list(self._procs.items())):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
            log.info("service_stopped", service=name)
        self._procs.clear()
        if self._nats is not None:
            await asyncio.to_thread(self._nats.cleanup)
        if self._auth_tmp is not None:
            shutil.rmtree(self._auth_tmp, ignore_errors=True)
