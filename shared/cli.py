"""The `trainmover` command line: drain, fail, status, watch, up, service, demo, bench, chaos,
version.

Every failure is one line on stderr and a non-zero exit (2 for bad input, 1 for a bus or
job error), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from trainmover import __version__, logs, replication
from trainmover.bus import BusUnreachable
from trainmover.client import TrainMoverClient, TrainMoverError
from trainmover.messages import TERMINAL_STATES, MessageError, MigrationProgress
from trainmover.natsserver import NatsServerError
from trainmover.security import credentials
from trainmover.security.credentials import CredentialsError
from trainmover.security.denials import PermissionDenied
from trainmover.subjects import InvalidName, check_name

SERVICES = ("health-monitor", "planner", "executor", "sidecar", "rendezvous")


class CliError(Exception):
    """Bad input on the command line (exit 2)."""


def _module_name(service: str) -> str:
    return "trainmover.services." + service.replace("-", "_")


def service_main(service: str) -> Callable[[list[str]], int]:
    """The `main(argv)` of a service, or CliError when this build does not have it."""
    if service not in SERVICES:
        raise CliError(f"unknown service {service!r} (choose from {', '.join(SERVICES)})")
    module = importlib.import_module(_module_name(service))
    main = getattr(module, "main", None)
    if main is None:
        raise CliError(f"service {service!r} is not available in this build yet")
    return main  # type: ignore[no-any-return]


async def _drain(args: argparse.Namespace) -> int:
    async with await TrainMoverClient.connect(args.nats_url) as tm:
        event_id = await tm.drain(args.job, args.machine, args.reason, args.deadline)
        print(event_id)
        return await _maybe_wait(tm, args, event_id)


async def _fail(args: argparse.Namespace) -> int:
    async with await TrainMoverClient.connect(args.nats_url) as tm:
        event_id = await tm.report_failure(args.job, args.machine, args.reason)
        print(event_id)
        return await _maybe_wait(tm, args, event_id)


async def _maybe_wait(tm: TrainMoverClient, args: argparse.Namespace, event_id: str) -> int:
    if args.wait is None:
        return 0
    progress = await tm.wait_for_migration(args.job, event_id, timeout=args.wait)
    print(_progress_line(progress))
    return 0 if progress.state == "done" else 1


def _progress_line(p: MigrationProgress) -> str:
    parts = [f"{p.state:<12}", f"event={p.event_id[:8]}"]
    if p.leaver:
        parts.append(f"{p.leaver} -> {p.joiner or '?'}")
    if p.downtime_s is not None:
        parts.append(f"downtime={p.downtime_s:.3f}s")
    if p.detail:
        parts.append(p.detail)
    return "  ".join(parts)


async def _status(args: argparse.Namespace) -> int:
    async with await TrainMoverClient.connect(args.nats_url) as tm:
        state = await tm.status(args.job)
        migrations = await tm.migrations(args.job)
    if args.json:
        doc = {
            "state": state.model_dump(mode="json"),
            "migrations": [m.model_dump(mode="json") for m in migrations],
        }
        print(json.dumps(doc, indent=2))
        return 0
    from trainmover import statusview  # rich only for the table

    statusview.render(state, migrations, every=args.all)
    return 0


async def _watch(args: argparse.Namespace) -> int:
    seen = 0
    async with await TrainMoverClient.connect(args.nats_url) as tm:
        async with tm.watch(args.job, from_start=args.from_start) as items:
            async for item in items:
                if args.json:
                    print(item.model_dump_json(), flush=True)
                elif isinstance(item, MigrationProgress):
                    print(_progress_line(item), flush=True)
                else:
                    print(
                        f"{'event':<12}  {item.kind} {item.machine or '-'} "
                        f"event={item.event_id[:8]} source={item.source} {item.reason}",
                        flush=True,
                    )
                seen += 1
                if args.count and seen >= args.count:
                    break
                if (
                    args.until_done
                    and isinstance(item, MigrationProgress)
                    and item.state in TERMINAL_STATES
                ):
                    break
    return 0


async def _up(args: argparse.Namespace) -> int:
    from trainmover.stack import Stack, available_services
    from trainmover.stackports import ServiceStartError, fixed_http_ports

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    machines = args.auth_machines.split(",") if args.auth_machines else None
    http_ports = None
    if args.fixed_ports is not None:
        try:
            http_ports = fixed_http_ports(available_services(), args.fixed_ports or None)
        except ValueError as err:
            raise CliError(str(err)) from None
    try:
        async with Stack(
            nats_url=args.nats_url,
            store_dir=args.store_dir,
            job_config=args.job_config,
            run_dir=args.run_dir,
            http_ports=http_ports,
            auth=args.auth,
            auth_machines=machines,
            nats_cluster=args.nats_cluster,
            rules=args.rules,
            store_replicas=args.store_replicas,
            store_shards=args.store_shards,
        ) as stack:
            await _serve_up(stack, args, stop)
    except ServiceStartError as err:
        raise CliError(f"trainmover up: {err}") from None
    return 0


async def _serve_up(stack: Any, args: argparse.Namespace, stop: asyncio.Event) -> None:
    """Prints where everything of a started stack is, then supervises it until `stop`."""
    print(f"export TRAINMOVER_NATS_URL={stack.url}", flush=True)
    if stack.operator_creds is not None:
        print(f"export TRAINMOVER_NATS_CREDS={stack.operator_creds}", flush=True)
    for name, port in stack.http_ports.items():
        print(f"{name}: http://127.0.0.1:{port}/metrics", flush=True)
    page = await _status_page(stack, args.status_port)
    print(
        f"trainmover up: running {', '.join(stack.running) or 'bus only'}; Ctrl-C stops everything",
        file=sys.stderr,
        flush=True,
    )
    try:
        await stack.wait(stop)
    finally:
        if page is not None:
            await page.stop()
            await page.view.nc.close()


async def _status_page(stack: Any, port: int) -> Any:
    """Serves the job's live status page (trainmover.statuspage) and prints its URL."""
    if stack.config is None:
        return None
    from trainmover import bus
    from trainmover.statuspage import StatusPage

    auth = credentials.from_file(stack.operator_creds) if stack.operator_creds else None
    nc = await bus.connect(stack.url, "status-page", auth=auth)
    page = StatusPage(nc, stack.config.job, stack.config.train.steps)
    url = await page.start("127.0.0.1", port)
    print(f"status page: {url}", flush=True)
    return page


def _chaos(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainmover.chaos import soak
    from trainmover.chaos.faults import default_kinds
    from trainmover.chaos.report import SoakSettings
    from trainmover.runtime.layout import Layout

    try:
        settings = SoakSettings(
            duration_s=args.duration,
            max_faults=args.max_faults,
            seed=args.seed,
            kinds=tuple(args.kinds.split(",")) if args.kinds else default_kinds(args.nats_cluster),
            workdir=Path(args.workdir) if args.workdir else None,
            recovery_timeout_s=args.recovery_timeout,
            dump_every=args.dump_every,
            standbys=args.standbys,
            reference=not args.no_reference,
            in_order=args.in_order,
            nats_cluster=args.nats_cluster,
            layout=Layout.parse(args.layout),
            store_shards=args.store_shards,
        )
    except ValueError as err:
        raise CliError(str(err)) from None
    return soak.main(settings, args.json)


def _name(what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        try:
            return check_name(what, value)
        except InvalidName as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    check.__name__ = what
    return check


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover", description=__doc__.splitlines()[0])
    p.add_argument("--nats-url", help="NATS server(s); default $TRAINMOVER_NATS_URL")
    p.add_argument(
        "--nats-replicas",
        type=int,
        metavar="N",
        help="copies of each stream and bucket (default: 3 on a NATS cluster, 1 on one server)",
    )
    p.add_argument("--log-format", choices=["json", "console"], help="log line format")
    p.add_argument("--log-level", default=None, help="debug, info, warning, error")
    credentials.add_arguments(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_wait(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--wait",
            type=float,
            metavar="SECONDS",
            help="wait for the migration to end; exit 1 unless it is done",
        )

    d = sub.add_parser("drain", help="planned migration of a machine")
    d.add_argument("job", type=_name("job"))
    d.add_argument("machine", type=_name("machine"))
    d.add_argument("--reason", default="")
    d.add_argument("--deadline", type=float, metavar="SECONDS", help="must be gone within")
    with_wait(d)

    f = sub.add_parser("fail", help="report a machine as failed")
    f.add_argument("job", type=_name("job"))
    f.add_argument("machine", type=_name("machine"))
    f.add_argument("--reason", default="")
    with_wait(f)

    s = sub.add_parser("status", help="machines, roles, standbys, migrations of a job")
    s.add_argument("job", type=_name("job"))
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--all",
        action="store_true",
        help="list each machine of a job too large to list by default (they are counted)",
    )

    w = sub.add_parser("watch", help="follow a job's events and migration progress")
    w.add_argument("job", type=_name("job"))
    w.add_argument("--from-start", action="store_true", help="replay what the bus holds")
    w.add_argument("--json", action="store_true")
    w.add_argument("--count", type=int, default=0, help="stop after N items")
    w.add_argument("--until-done", action="store_true", help="stop at the first ended migration")

    u = sub.add_parser("up", help="start the embedded stack (NATS, services, local cluster)")
    u.add_argument("--store-dir", help="JetStream state directory (default: temporary)")
    u.add_argument("--job-config", help="job config file: starts its local cluster too")
    u.add_argument("--run-dir", help="where machines keep worker logs (default: temporary)")
    u.add_argument(
        "--auth",
        action="store_true",
        help="generate per-component credentials and run the bus with least-privilege users",
    )
    u.add_argument(
        "--rules",
        metavar="FILE",
        help="the health-monitor's alert rules (default: deploy/health-monitor-rules.yaml)",
    )
    u.add_argument(
        "--auth-machines",
        metavar="M1,M2",
        help="machines that get sidecar credentials (default: the job config's machines and standbys)",
    )
    u.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="run the bus as a JetStream cluster of N embedded servers on loopback",
    )
    u.add_argument(
        "--store-replicas",
        type=int,
        default=0,
        metavar="N",
        help="run the rendezvous store as N rendezvous services, one serving and the others "
        "standing by (default: one store in this process)",
    )
    u.add_argument(
        "--store-shards",
        type=int,
        default=0,
        metavar="N",
        help="count the per-step commit vote in N stores beside the rendezvous store "
        "(each replica hosts them): for jobs of many machines (docs/runtime.md)",
    )
    u.add_argument(
        "--status-port", type=int, default=0, help="port of the status page (default: a free one)"
    )
    u.add_argument(
        "--fixed-ports",
        type=int,
        nargs="?",
        const=0,
        metavar="BASE",
        help="serve the services' /metrics on fixed ports (a Prometheus scrape's): the "
        "well-known 9464-9466, or BASE, BASE+1, BASE+2 (default: free ports, printed)",
    )

    a = sub.add_parser("auth", help="generate credentials and nats-server configs")
    a.add_argument("args", nargs=argparse.REMAINDER, help="see `trainmover auth --help`")

    sv = sub.add_parser("service", help="run one service in the foreground")
    sv.add_argument("name", choices=SERVICES)
    sv.add_argument("args", nargs=argparse.REMAINDER, help="the service's own options")

    dm = sub.add_parser("demo", help="the main job on the embedded default, with migrations")
    dm.add_argument("--json", metavar="FILE", help="write the report as JSON")
    dm.add_argument(
        "--steps",
        type=int,
        help="the most steps the job trains (default 600; --example ddp 3000, llama 1500); it "
        "ends a few steps after its last migration",
    )
    dm.add_argument("--workdir", help="where runs and logs go (default: temporary)")
    dm.add_argument("--example", help="run examples/NAME instead of the reference job (ddp, llama)")
    dm.add_argument(
        "--verbose", action="store_true", help="stream the services' logs instead of files"
    )

    b = sub.add_parser("bench", help="benchmarks: downtime, rebalance, scale (docs/benchmarks.md)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="benchmark and its options")

    ch = sub.add_parser("chaos", help="soak the local cluster in random faults, check invariants")
    ch.add_argument(
        "--duration",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="inject faults for this long (default 600)",
    )
    ch.add_argument("--max-faults", type=int, default=40, help="at most this many faults")
    ch.add_argument("--seed", type=int, help="random seed (default: random, printed)")
    ch.add_argument("--kinds", help="comma list of fault kinds (default: all)")
    ch.add_argument("--workdir", help="where runs and logs go (default: temporary)")
    ch.add_argument("--recovery-timeout", type=float, default=300.0, metavar="SECONDS")
    ch.add_argument("--dump-every", type=int, default=20, help="steps between state dumps")
    ch.add_argument("--standbys", type=int, default=2, help="standby machines of the job")
    ch.add_argument(
        "--layout",
        default="2x2x2",
        help="the job's TPxPPxDP (default 2x2x2: 4 machines of 2 ranks)",
    )
    ch.add_argument(
        "--in-order", action="store_true", help="take --kinds in order instead of at random"
    )
    ch.add_argument("--no-reference", action="store_true", help="skip the reference run")
    ch.add_argument(
        "--nats-cluster", type=int, default=1, metavar="N", help="the bus as N embedded servers"
    )
    ch.add_argument(
        "--store-shards",
        type=int,
        default=0,
        metavar="N",
        help="count the commit vote in N shards of the rendezvous store (killed with it)",
    )
    ch.add_argument("--json", metavar="FILE", help="write the report as JSON")

    sub.add_parser("version", help="print the version")
    return p


QUIET_COMMANDS = frozenset({"drain", "fail", "status", "watch", "demo"})
"""Commands that log at warning unless told otherwise."""

COMMANDS: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
    "drain": _drain,
    "fail": _fail,
    "status": _status,
    "watch": _watch,
    "up": _up,
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # Commands a person runs at a terminal show their answer, not the bus client's info
    # lines; --log-level or $TRAINMOVER_LOG_LEVEL still win.
    quiet = args.command in QUIET_COMMANDS and not os.environ.get(logs.LEVEL_ENV)
    logs.configure(args.log_format, args.log_level or ("warning" if quiet else None))
    try:
        if args.command == "version":
            print(f"trainmover {__version__}")
            return 0
        if args.command == "bench":
            from trainmover.bench.cli import main as bench_main  # matplotlib etc. on demand

            return bench_main(args.args)
        if args.command == "auth":
            from trainmover.security import authcli

            return authcli.main(args.args)
        credentials.set_default(credentials.from_args(args))
        if args.nats_replicas is not None:
            # The environment carries it to every process this one starts.
            os.environ[replication.REPLICAS_ENV] = str(args.nats_replicas)
            replication.configured()
        if args.command in ("demo", "chaos"):
            _terminate_as_interrupt()
        if args.command == "demo":
            from trainmover import demo, demo_examples

            try:
                demo_examples.pick(args.example)
            except ValueError as err:
                raise CliError(str(err)) from None
            return demo.main(args.json, args.steps, args.workdir, args.example, args.verbose)
        if args.command == "chaos":
            return _chaos(args)
        if args.command == "service":
            extra = (["--nats-url", args.nats_url] if args.nats_url else []) + args.args
            return service_main(args.name)(extra)
        return asyncio.run(COMMANDS[args.command](args))
    except (CliError, InvalidName, MessageError, replication.ReplicationError) as err:
        print(f"trainmover: error: {err}", file=sys.stderr)
        return 2
    except CredentialsError as err:
        print(f"trainmover: error: {err}", file=sys.stderr)
        return 2
    except (TrainMoverError, BusUnreachable, NatsServerError, PermissionDenied) as err:
        print(f"trainmover: error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # pydantic validation of CLI-built messages
        print(f"trainmover: error: invalid input: {_first_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _terminate_as_interrupt() -> None:
    """SIGTERM stops a command that runs a local cluster the way Ctrl-C does: its
    processes are stopped on the way out instead of outliving it as orphans."""
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))


def _first_line(err: Exception) -> str:
    text = str(err)
    if hasattr(err, "errors"):
        first = err.errors()[0]
        return f"field '{'.'.join(map(str, first['loc']))}': {first['msg']}"
    return text.splitlines()[0] if text else type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
