"""What every service's `main` shares: settings errors, signals, exit codes.

    def main(argv=None) -> int:
        return run_service("planner", lambda: load(argv), Planner)

`load` returns settings (or raises SettingsError: exit 2, one line); the service class
is built from the settings and must provide `async start()` and `async stop()`. The
service runs until SIGINT/SIGTERM; an unreachable bus exits 1 with one line. SIGUSR1
writes every thread's stack to stderr (where a service that does not stop waits).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol

from nats.aio.client import Client as NatsClient

from trainmover import bus, logs
from trainmover.bus import BusUnreachable
from trainmover.httpserver import HttpServer, serve_observability
from trainmover.metrics import Registry
from trainmover.runtime.config import JobConfig, load_config
from trainmover.security.credentials import CredentialsError


class SettingsError(ValueError):
    """Bad flags, environment or files: the service cannot start (exit 2)."""


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def run_service(
    name: str,
    load: Callable[[], Any],
    build: Callable[[Any], Service],
    settings_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Loads settings, configures logging, runs the service until a signal.
    `settings_errors` are the service's own exceptions for bad settings (exit 2, as
    SettingsError)."""
    # A stop asked for while the service still starts (imports, connecting) is a clean
    # stop too; once running, the event loop's handlers take over.
    signal.signal(signal.SIGTERM, _stop_while_starting)
    logs.stacks_on_sigusr1()
    bad_settings: tuple[type[Exception], ...] = (SettingsError, *settings_errors)
    try:
        settings = load()
    except bad_settings as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    logs.configure(getattr(settings, "log_format", None), getattr(settings, "log_level", None))
    try:
        return asyncio.run(_run(build(settings)))
    except bad_settings as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except (BusUnreachable, CredentialsError, OSError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except _StoppedWhileStarting:
        return 0


class _StoppedWhileStarting(BaseException):
    pass


def _stop_while_starting(_signum: int, _frame: object) -> None:
    raise _StoppedWhileStarting


async def _run(service: Service) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        await stop.wait()
    finally:
        await service.stop()
    return 0


def http_parser(prog: str, http_port: int) -> argparse.ArgumentParser:
    """The flags every service takes (its HTTP port and logs); a service adds its own."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--http-host", default="127.0.0.1", help="address of /metrics and /healthz")
    p.add_argument("--http-port", type=int, default=http_port, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound HTTP port here")
    p.add_argument("--log-format", choices=["json", "console"])
    p.add_argument("--log-level")
    return p


def base_parser(prog: str, http_port: int) -> argparse.ArgumentParser:
    """The flags of a service on the bus: `http_parser`'s, the bus and the job config."""
    p = http_parser(prog, http_port)
    p.add_argument(
        "--nats-url",
        default=os.environ.get("TRAINMOVER_NATS_URL"),
        help="NATS server(s); default $TRAINMOVER_NATS_URL",
    )
    p.add_argument("--job-config", help="the job config file (YAML or JSON)")
    return p


def parse(
    parser: argparse.ArgumentParser, argv: list[str] | None, needs_bus: bool = True
) -> argparse.Namespace:
    """Parses `argv`; a usage error becomes SettingsError (one line, exit 2)."""

    class _Raising(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise SettingsError(message)

    parser.__class__ = _Raising
    args = parser.parse_args(argv)
    if needs_bus and not args.nats_url:
        raise SettingsError("no NATS URL: pass --nats-url or set TRAINMOVER_NATS_URL")
    return args


def load_job_config(path: str | None) -> JobConfig:
    """The job config at `path`, or SettingsError with the reason."""
    if not path:
        raise SettingsError("--job-config FILE is required")
    try:
        return load_config(path)
    except (OSError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SettingsError(f"cannot read job config {path}: {first}") from None


class Observable(Service, Protocol):
    metrics: Registry

    def health(self) -> dict[str, object]: ...


class OnBus:
    """Runs a service that needs a bus connection, with /metrics and /healthz.

    `build(nc)` makes the service once connected; it is started, served over HTTP, and
    stopped (then the connection drained) on shutdown.
    """

    def __init__(
        self, name: str, args: argparse.Namespace, build: Callable[[NatsClient], Observable]
    ) -> None:
        self.name = name
        self.args = args
        self.log_format = args.log_format
        self.log_level = args.log_level
        self._build = build
        self._nc: NatsClient | None = None
        self.service: Observable | None = None
        self._http: HttpServer | None = None

    async def start(self) -> None:
        self._nc = await bus.connect(self.args.nats_url, self.name)
        self.service = self._build(self._nc)
        await self.service.start()
        self._http = await serve_observability(
            self.service.metrics, self.service.health, self.args.http_host, self.args.http_port
        )
        write_port_file(self.args.port_file, self._http.port)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
        if self.service is not None:
            await self.service.stop()
        if self._nc is not None and self._nc.is_connected:
            # Everything durable was acked already; a drain would wait out pull
            # subscriptions with a fetch in flight.
            with contextlib.suppress(Exception):
                await self._nc.flush(timeout=2)
            await self._nc.close()


def write_port_file(path: Path | None, port: int) -> None:
    """Writes the bound HTTP port for whoever started us with --http-port 0 (atomically)."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)
