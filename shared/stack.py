"""The embedded stack behind `trainmover up`: bus, services and a local cluster, supervised.

- the bus: an existing NATS when given a URL, else the embedded nats-server, or with
  `nats_cluster` N > 1 a JetStream cluster of N embedded servers
  (trainmover.natscluster) whose streams and buckets are replicated;
- the services (planner, executor, health-monitor), each its own process, so they only
  ever talk over the bus; one that dies is restarted (each resumes from durable state);
- with a job config, the local cluster: the rendezvous store (hosted here, never on a
  training machine; with `store_replicas` N, N rendezvous service processes, one
  serving and the others standing by, restarted like the services; with `store_shards`
  S, each hosts S stores of the commit vote beside it) and one sidecar process per
  machine and standby, each in its own process group so that `kill_machine` takes a
  whole machine down like a power cut.

With `auth`, the stack generates per-component credentials and a nats-server config
(trainmover.security) into `<store>/auth/`, runs the embedded server with it, and gives
each process its own credentials file (TRAINMOVER_NATS_CREDS) and
TRAINMOVER_NATS_REQUIRE_AUTH=1, so nothing runs against an open bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import cast

from trainmover.logs import get_logger
from trainmover.natscluster import EmbeddedNatsCluster
from trainmover.natsserver import EmbeddedNats, resolve_url
from trainmover.replication import REPLICAS_ENV
from trainmover.runtime.config import JobConfig, load_config
from trainmover.runtime.storegate import SECRET_ENV
from trainmover.security.credentials import CREDS_ENV, ENV
from trainmover.security.policy import Component, Role
from trainmover.stackports import check_free, wait_served
from trainmover.stackstore import REPLICA, StackStore

log = get_logger("stack")


# Start order: consumers before producers, so nothing published at start is missed.
STACK_SERVICES = ("planner", "executor", "health-monitor")
#: Those that need the job config (the health-monitor idles without one).
JOB_SERVICES = ("planner", "executor")
#: Per machine: a command prefix for its sidecar and environment additions.
MachineWrap = Callable[[str], tuple[list[str], dict[str, str]]]

SHIPPED_RULES = Path(__file__).resolve().parents[1] / "deploy" / "health-monitor-rules.yaml"
"""The alert rules the health-monitor of `trainmover up` maps Alertmanager alerts with."""


def default_rules() -> str | None:
    """The shipped rules file, where this install has it (a checkout of the project)."""
    return str(SHIPPED_RULES) if SHIPPED_RULES.is_file() else None


def available_services() -> list[str]:
    """The services of STACK_SERVICES whose package provides `main` in this build."""
    found = []
    for name in STACK_SERVICES:
        module = importlib.import_module("trainmover.services." + name.replace("-", "_"))
        if hasattr(module, "main"):
            found.append(name)
    return found


class Stack:
    """Bus, services and (with a job config, unless `cluster` is False) the local cluster;
    an async context manager.

    `service_args` adds flags per service name ("sidecar" for every sidecar);
    `http_ports` fixes the HTTP ports of services (default: free ones). `host` is
    the address the embedded bus and the rendezvous store listen on and everyone dials
    (loopback unless machines run apart, e.g. in network namespaces); `machine_wrap`
    gives, per machine, a command prefix for its sidecar and environment additions (how
    a test runs a machine inside a namespace).
    """

    def __init__(
        self,
        nats_url: str | None = None,
        store_dir: str | None = None,
        job_config: str | None = None,
        services: list[str] | None = None,
        run_dir: str | Path | None = None,
        service_args: dict[str, list[str]] | None = None,
        http_ports: dict[str, int] | None = None,
        cluster: bool = True,
        auth: bool = False,
        auth_machines: list[str] | None = None,
        bcrypt_cost: int | None = None,
        nats_cluster: int = 1,
        log_dir: str | Path | None = None,
        rules: str | None = None,
        host: str = "127.0.0.1",
        machine_wrap: MachineWrap | None = None,
        store_replicas: int = 0,
        store_shards: int = 0,
    ) -> None:
        self.host = host
        #: The job's rendezvous store: hosted here, or its replicas' processes.
        self.store = StackStore(host, store_replicas, store_shards)
        self._machine_wrap = machine_wrap
        self._given_url = resolve_url(nats_url)
        self._store_dir = store_dir
        self._job_config = str(Path(job_config).resolve()) if job_config else None
        self.config: JobConfig | None = load_config(job_config) if job_config else None
        self._services = available_services() if services is None else services
        if self._job_config is None:  # they serve a job: without one they cannot start
            self._services = [n for n in self._services if n not in JOB_SERVICES]
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="trainmover-run-"))
        self._service_args = service_args or {}
        #: Where each process's output goes (<name>.log); None: this process's terminal.
        self.log_dir = Path(log_dir) if log_dir else None
        #: The services' fixed HTTP ports (None: each takes a free one).
        self._fixed_http = http_ports or {}
        #: The HTTP port each service serves on, once it serves (`trainmover.stackports`).
        self.http_ports: dict[str, int] = {}
        self._cluster = cluster
        self._nats: EmbeddedNats | None = None
        self._nats_cluster_size = nats_cluster
        #: The embedded JetStream cluster (with `nats_cluster` > 1).
        self.nats_cluster: EmbeddedNatsCluster | None = None
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self.machines: dict[str, asyncio.subprocess.Process] = {}
        self.url = ""
        self.auth = auth
        self._auth_machines = auth_machines
        self._bcrypt_cost = bcrypt_cost
        self.rules = str(Path(rules).resolve()) if rules else default_rules()
        self._auth_tmp: str | None = None
        self.auth_dir: Path | None = None
        self.jobs: dict[str, list[str]] = {}
        if auth and self._given_url:
            raise ValueError(
                "--auth generates credentials for the embedded server; against an existing "
                "server give each service its own credentials (TRAINMOVER_NATS_CREDS)"
            )
        if nats_cluster > 1 and self._given_url:
            raise ValueError("--nats-cluster starts its own servers: it takes no --nats-url")

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
        config = load_config(self._job_config)
        machines = self._auth_machines
        if machines is None:
            machines = [*config.cluster.machines, *config.cluster.standbys]
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
        return [*self._procs, *(f"sidecar {m}" for m in self.machines)]

    def pids(self) -> dict[str, int]:
        """The process id of each service and of each embedded nats-server ("nats-<i>"),
        by name: what a benchmark reads CPU and memory of."""
        pids = {name: proc.pid for name, proc in self._procs.items()}
        nodes = self.nats_cluster.nodes if self.nats_cluster is not None else [self._nats]
        for i, node in enumerate(nodes):
            if node is not None and node.pid is not None:
                pids[f"nats-{i}"] = node.pid
        return pids

    async def __aenter__(self) -> Stack:
        if self._given_url:
            self.url = self._given_url
        else:
            config = await asyncio.to_thread(self._setup_auth) if self.auth else None
            if self._nats_cluster_size > 1:
                cluster = EmbeddedNatsCluster(self._nats_cluster_size, self._store_dir, config)
                self.nats_cluster = await asyncio.to_thread(cluster.start)
                self.url = cluster.url
            else:
                server = EmbeddedNats(self._store_dir, config_file=config, host=self.host)
                self._nats = await asyncio.to_thread(server.start)
                self.url = self._nats.url
        embedded = self._nats is not None or self.nats_cluster is not None
        log.info("bus_ready", url=self.url, embedded=embedded, auth=self.auth)
        try:
            check_free({n: p for n, p in self._fixed_http.items() if n in self._services})
            for name in self._services:
                await self._spawn(name)
            if self.config is not None and self._cluster:
                await self._start_cluster(self.config)
            await self._wait_served()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    # --- services ------------------------------------------------------------------------

    def _args(self, name: str, *extra: str) -> list[str]:
        args = [sys.executable, "-m", "trainmover.cli", "--nats-url", self.url, "service", name]
        if self._job_config:
            args += ["--job-config", self._job_config]
        # Sidecars share a host here, so they always take free ports; the services take
        # fixed ones (for a Prometheus scrape) when asked.
        args += ["--http-port", str(self._fixed_http.get(name, 0))]
        if name != "sidecar":
            args += ["--port-file", str(self._port_file(name))]
        if name == "health-monitor":
            # Machines starting together on a small host take seconds before their first
            # heartbeat (each imports torch); do not take that for a failure.
            args += ["--startup-grace", "60"]
            if self.rules:
                args += ["--rules", self.rules]
        return args + list(extra) + self._service_args.get(name, [])

    @property
    def rendezvous_address(self) -> str:
        """HOST:PORT[,...] of the job's store replicas, as the sidecars dial them."""
        return self.store.address

    def _service_env(self, name: str, machine: str | None = None) -> dict[str, str]:
        env = {**os.environ, "TRAINMOVER_NATS_URL": self.url}
        if self.store.secret_file is not None and name == "sidecar":
            env[SECRET_ENV] = str(self.store.secret_file)  # its workers inherit it
        if self.auth:
            # Each process gets its own identity, never the operator's credentials.
            keep = (ENV + "URL", REPLICAS_ENV)
            env = {k: v for k, v in env.items() if not k.startswith(ENV) or k in keep}
            role = cast(Role, name)  # STACK_SERVICES and "sidecar" are roles of the policy
            env.update(self.creds_env(Component(role, tuple(sorted(self.jobs)), machine)))
        return env

    async def _exec(
        self, args: list[str], env: dict[str, str], log_name: str, new_group: bool = False
    ) -> asyncio.subprocess.Process:
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{log_name}.log", "ab")  # noqa: ASYNC230, SIM115
        try:
            return await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT if out else None,
                start_new_session=new_group,
                env=env,
            )
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor

    def _port_file(self, name: str) -> Path:
        return self.run_dir / "ports" / f"{name}.port"

    async def _wait_served(self) -> None:
        """Returns once every service serves (self.http_ports); ServiceStartError naming
        the first that exited before it did, and the port it could not bind."""
        names = [n for n in self._services if not n.startswith(REPLICA)]
        ports = await asyncio.gather(
            *(
                wait_served(n, self._procs[n], self._port_file(n), self._fixed_http.get(n))
                for n in names
            )
        )
        self.http_ports = dict(zip(names, ports, strict=True))
        log.info("services_serving", ports=self.http_ports)

    async def _spawn(self, name: str) -> None:
        if name.startswith(REPLICA):
            args = self.store.replica_args(sys.executable, int(name[len(REPLICA) :]))
            env = dict(os.environ)
        else:
            self._port_file(name).parent.mkdir(parents=True, exist_ok=True)
            self._port_file(name).unlink(missing_ok=True)
            args, env = self._args(name), self._service_env(name)
        self._procs[name] = await self._exec(args, env, name)
        log.info("service_started", service=name, pid=self._procs[name].pid)

    def serving_replica(self) -> tuple[str, str]:
        """The store replica that serves now ("rendezvous-<i>") and its incarnation."""
        return self.store.serving_replica()

    async def restart_service(self, name: str, kill: bool = True) -> None:
        """Kills (or stops) one service and starts it again, as a crash and a restart."""
        proc = self._procs[name]
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        await proc.wait()
        await self._spawn(name)

    async def restart_bus(self, kill: bool = True) -> None:
        """Crashes (or stops) the embedded nats-server (every server of the embedded
        cluster at once) and starts it again on its port with its JetStream state; every
        process reconnects on its own."""
        if self.nats_cluster is not None:
            await asyncio.to_thread(self.nats_cluster.restart_all, kill)
        elif self._nats is not None:
            await asyncio.to_thread(self._nats.restart, kill)
        else:
            raise RuntimeError("the stack runs against an external server; restart it there")
        log.info("bus_restarted", url=self.url, kill=kill)

    def bus_cluster(self) -> EmbeddedNatsCluster:
        """The embedded JetStream cluster, or RuntimeError without `nats_cluster`."""
        if self.nats_cluster is None:
            raise RuntimeError("the stack runs no embedded nats cluster (--nats-cluster N)")
        return self.nats_cluster

    # --- local cluster ---------------------------------------------------------------------

    async def _start_cluster(self, config: JobConfig) -> None:
        if self.auth_dir is not None:
            self.store.gate(self.auth_dir, config.job)

        def exit_code(name: str) -> int | None:
            return self._procs[name].returncode

        await self.store.start(self._spawn, exit_code)
        for machine in [*config.cluster.machines, *config.cluster.standbys]:
            await self.start_machine(machine)

    async def start_machine(self, machine: str) -> None:
        """Starts the sidecar of `machine` (which starts its workers)."""
        args = self._args(
            "sidecar",
            "--machine",
            machine,
            "--rendezvous",
            self.rendezvous_address,
            "--run-dir",
            str(self.run_dir / machine),
        )
        env = self._service_env("sidecar", machine)
        if self._machine_wrap is not None:
            prefix, extra = self._machine_wrap(machine)
            args, env = [*prefix, *args], {**env, **extra}
        self.machines[machine] = await self._exec(args, env, f"sidecar-{machine}", new_group=True)
        log.info("machine_started", machine=machine, pid=self.machines[machine].pid)

    def kill_machine(self, machine: str) -> None:
        """SIGKILLs the machine's sidecar and every worker process on it at once."""
        proc = self.machines[machine]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.info("machine_killed", machine=machine)

    # --- supervision -------------------------------------------------------------------------

    async def first_exit(self) -> tuple[str, int]:
        """Waits until a service's process exits; its name and exit code (what a benchmark
        that supervises nothing fails its run on)."""
        waits = {asyncio.ensure_future(p.wait()): n for n, p in self._procs.items()}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        task = done.pop()
        return waits[task], task.result()

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

    @staticmethod
    async def _stop_all(procs: dict[str, asyncio.subprocess.Process], group: bool) -> None:
        """SIGTERM to every process of `procs`, SIGKILL (to its process group when
        `group`) to those still running after 20 s."""

        async def stop(name: str, proc: asyncio.subprocess.Process) -> None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
                await proc.wait()
            log.info("process_stopped", name=name)

        await asyncio.gather(*(stop(name, proc) for name, proc in procs.items()))

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The health-monitor first: machines stopped on purpose are not failures, and a
        # monitor still watching reports them and the planner plans recoveries for a
        # job being shut down. Then the machines (their workers must not outlive the
        # bus), each tier at once, then the planner and the executor.
        monitor = {n: p for n, p in self._procs.items() if n == "health-monitor"}
        await self._stop_all(monitor, group=False)
        await self._stop_all(self.machines, group=True)
        await self._stop_all(
            {n: p for n, p in self._procs.items() if n not in monitor}, group=False
        )
        self.machines.clear()
        self._procs.clear()
        self.store.close()
        if self._nats is not None:
            await asyncio.to_thread(self._nats.cleanup)
        if self.nats_cluster is not None:
            await asyncio.to_thread(self.nats_cluster.cleanup)
        if self._auth_tmp is not None:
            shutil.rmtree(self._auth_tmp, ignore_errors=True)
