"""The embedded stack behind `trainmover up`: the bus, then every service, supervised.

Uses an existing NATS when given a URL, else starts the embedded nats-server. Each
service runs as its own process (`trainmover service NAME`), so they only ever talk over
the bus; a service that dies is restarted (each one resumes from the bus's durable
state). Services that this build does not have yet are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import sys
from pathlib import Path
from types import TracebackType

from trainmover.logs import get_logger
from trainmover.natsserver import EmbeddedNats, resolve_url

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
    ) -> None:
        self._given_url = resolve_url(nats_url)
        self._store_dir = store_dir
        self._job_config = job_config
        self._services = available_services() if services is None else services
        self._nats: EmbeddedNats | None = None
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self.url = ""

    @property
    def running(self) -> list[str]:
        return list(self._procs)

    async def __aenter__(self) -> Stack:
        if self._given_url:
            self.url = self._given_url
        else:
            self._nats = await asyncio.to_thread(EmbeddedNats(self._store_dir).start)
            self.url = self._nats.url
        log.info("bus_ready", url=self.url, embedded=self._nats is not None)
        for name in self._services:
            await self._spawn(name)
        return self

    def _service_args(self, name: str) -> list[str]:
        args = [sys.executable, "-m", "trainmover.cli", "--nats-url", self.url, "service", name]
        if self._job_config:
            args += ["--job-config", str(Path(self._job_config).resolve())]
        return args

    async def _spawn(self, name: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self._service_args(name),
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, "TRAINMOVER_NATS_URL": self.url},
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
