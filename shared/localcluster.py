"""A local cluster to drive and observe: the stack of `trainmover up` plus a bus client.

Used by `trainmover demo` and the end-to-end tests: it starts the whole system as
separate processes (embedded nats-server, planner, executor, health-monitor, one sidecar
per machine with its worker processes), follows the job's step statistics, and offers
waits on what the system publishes (a step reached, a cluster state, the end of
training), each with a deadline and none by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from trainmover import bus
from trainmover.client import TrainMoverClient
from trainmover.messages import (
    ClusterState,
    Command,
    CommandOp,
    Heartbeat,
    StepStats,
    decode,
)
from trainmover.runtime.compare import mismatches, skipped_roles, state_files
from trainmover.runtime.config import JobConfig, save_config
from trainmover.security.credentials import NatsAuth, from_file
from trainmover.security.policy import Component
from trainmover.stack import MachineWrap, Stack
from trainmover.subjects import JobSubjects

#: Fast signals for a local cluster: heartbeats every 0.2 s, a machine is dead after 10 s
#: of silence. A killed machine that trains is reported much sooner by its neighbours'
#: failed collectives; silence only decides for idle standbys, and at 3 s a sidecar
#: starved of CPU on a loaded 2-core host was declared failed while alive.
FAST_SIGNALS: dict[str, list[str]] = {
    "sidecar": ["--heartbeat-interval", "0.2"],
    "health-monitor": ["--heartbeat-interval", "0.2", "--heartbeat-timeout-intervals", "50"],
}


class LocalCluster:
    """The stack for `config`, started in `workdir` (its bus a JetStream cluster of
    `nats_cluster` servers when above 1); an async context manager. `host` and
    `machine_wrap` are the stack's (machines in network namespaces)."""

    def __init__(
        self,
        config: JobConfig,
        workdir: Path,
        service_args: dict[str, list[str]] | None = None,
        nats_cluster: int = 1,
        log_dir: Path | None = None,
        auth: bool = False,
        bcrypt_cost: int | None = None,
        host: str = "127.0.0.1",
        machine_wrap: MachineWrap | None = None,
        store_replicas: int = 0,
        store_shards: int = 0,
    ) -> None:
        self.config = config
        self.job = config.job
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = save_config(config, workdir / "job.json")
        self.stack = Stack(
            job_config=str(config_path),
            run_dir=workdir / "run",
            service_args=service_args or FAST_SIGNALS,
            nats_cluster=nats_cluster,
            log_dir=log_dir,
            auth=auth,
            bcrypt_cost=bcrypt_cost,
            host=host,
            machine_wrap=machine_wrap,
            store_replicas=store_replicas,
            store_shards=store_shards,
        )
        self.steps: dict[str, int] = {}
        #: machine -> step -> when its sidecar stamped that step's statistics (a step
        #: re-executed after a recovery keeps its later stamp).
        self.step_ts: dict[str, dict[int, float]] = {}
        self._stepped = asyncio.Condition()
        self._nc: NatsClient | None = None
        self._client: TrainMoverClient | None = None

    @property
    def nc(self) -> NatsClient:
        assert self._nc is not None, "cluster not started"
        return self._nc

    @property
    def client(self) -> TrainMoverClient:
        assert self._client is not None, "cluster not started"
        return self._client

    async def __aenter__(self) -> LocalCluster:
        await self.stack.__aenter__()
        try:
            # Under auth the observer (step statistics, fault injection) is the operator
            # (admin); the client speaks as the job's client, with only its rights.
            admin = self._creds(Component("admin"))
            self._nc = await bus.connect(self.stack.url, "local-cluster", auth=admin)
            await self._nc.subscribe(JobSubjects(self.job).all_stats, cb=self._on_stats)
            if self.stack.auth:
                client = self._creds(Component("client", (self.job,)))
                self._client = await TrainMoverClient.connect(self.stack.url, auth=client)
            else:
                self._client = TrainMoverClient(self._nc)
        except BaseException:
            await self.stack.__aexit__(None, None, None)
            raise
        return self

    def _creds(self, component: Component) -> NatsAuth | None:
        """`component`'s credentials under auth; None (the default) without."""
        if not self.stack.auth:
            return None
        return from_file(self.stack.creds_file(component))

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.stack.auth and self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        await self.stack.__aexit__(et, ev, tb)

    async def _on_stats(self, msg: Msg) -> None:
        stats = decode(StepStats, msg.data)
        async with self._stepped:
            self.steps[stats.machine] = max(self.steps.get(stats.machine, -1), stats.step)
            self.step_ts.setdefault(stats.machine, {})[stats.step] = stats.ts
            self._stepped.notify_all()

    # --- waits -----------------------------------------------------------------------------

    async def wait_step(self, machine: str, step: int, timeout: float) -> None:
        """Until `machine` reported a step >= `step` (its step statistics)."""
        async with self._stepped:
            await asyncio.wait_for(
                self._stepped.wait_for(lambda: self.steps.get(machine, -1) >= step), timeout
            )

    async def wait_step_after(self, machine: str, t: float, timeout: float) -> tuple[int, float]:
        """Until `machine` reported a step stamped after `t`; returns the first such
        (step, stamp)."""

        def first() -> tuple[int, float] | None:
            after = [(ts, s) for s, ts in self.step_ts.get(machine, {}).items() if ts > t]
            return (min(after)[1], min(after)[0]) if after else None

        async with self._stepped:
            await asyncio.wait_for(self._stepped.wait_for(lambda: first() is not None), timeout)
        found = first()
        assert found is not None
        return found

    async def wait_state(
        self, predicate: Callable[[ClusterState], bool], timeout: float
    ) -> ClusterState:
        """Until the planner's cluster state satisfies `predicate`; returns that state."""
        return await asyncio.wait_for(bus.state_until(self.nc, self.job, predicate), timeout)

    async def wait_standbys_warm(self, timeout: float) -> ClusterState:
        """Until every configured standby is in the pool, warm for some role type: a
        migration asked for before then waits (a drain) or falls back (a failure)."""
        standbys = self.config.cluster.standbys
        return await self.wait_state(
            lambda s: all(
                m in s.machines
                and s.machines[m].status == "standby"
                and s.machines[m].warm_role_types
                for m in standbys
            ),
            timeout,
        )

    async def wait_finished(self, timeout: float) -> list[str]:
        """Until every worker of every active machine exited cleanly (training ended);
        returns those machines (from a state with no migration in flight: a joiner whose
        migration just ended may not be marked active yet)."""
        state = await self.wait_state(lambda s: not s.in_flight, timeout)
        machines = {n for n, m in state.machines.items() if m.status == "active"}
        finished: set[str] = set()
        done = asyncio.Event()

        async def on_beat(msg: Msg) -> None:
            beat = decode(Heartbeat, msg.data)
            if beat.workers and all(w.state == "exited" and w.exit_code == 0 for w in beat.workers):
                finished.add(beat.machine)
                if finished >= machines:
                    done.set()

        sub = await self.nc.subscribe(JobSubjects(self.job).heartbeats, cb=on_beat)
        try:
            await asyncio.wait_for(done.wait(), timeout)
        finally:
            await sub.unsubscribe()
        return sorted(machines)

    async def _each_active(self, op: CommandOp, step: int, timeout: float) -> list[str]:
        """`op` at `step` to every active machine once no migration is in flight; the
        machines, or the first refusal (RuntimeError naming machine and reason)."""
        state = await self.wait_state(lambda s: not s.in_flight, timeout)
        machines = sorted(n for n, m in state.machines.items() if m.status == "active")

        async def one(machine: str) -> None:
            args = {"step": step, "timeout_s": timeout}
            command = Command(job=self.job, machine=machine, op=op, args=args)
            reply = await bus.request(self.nc, command, timeout=10.0, deadline_s=timeout)
            if not reply.ok:
                raise RuntimeError(f"{op} at step {step} on {machine}: {reply.error}")

        await asyncio.gather(*(one(m) for m in machines))
        return machines

    async def hold(self, timeout: float, margin: int = 30) -> int:
        """Holds every active machine at a step a little past the furthest one reported
        (`margin` steps, rounded up to a multiple of 10, never past the job's last step;
        a later one when a rank turns out to be past it: the step statistics lag the
        training). Returns that step; `release` (or a later hold) lets them go on."""
        lead = margin
        while True:
            ahead = -(-(max(self.steps.values(), default=0) + lead) // 10) * 10
            step = min(ahead, self.config.train.steps)
            try:
                await self._each_active("hold", step, timeout)
                return step
            except RuntimeError as err:
                if "already past" not in str(err) or lead >= 8 * margin:
                    raise
                lead *= 2  # the held machines are released by the next, higher step

    async def release(self, timeout: float) -> None:
        """Lets every active machine train on to the job's last step (after `hold`)."""
        await self._each_active("hold", self.config.train.steps, timeout)

    async def finish_soon(self, timeout: float, margin: int = 30) -> tuple[int, list[str]]:
        """Ends the job ahead of its last step: every active machine is held (`hold`),
        then finishes there. Returns that step and the machines, once their workers
        exited cleanly."""
        step = await self.hold(timeout, margin)
        machines = await self._each_active("finish", step, timeout)
        finished = await self.wait_finished(timeout)
        if finished != machines:
            raise RuntimeError(f"finished {finished}, active were {machines}")
        return step, finished

    async def worker_pids(self, machine: str, timeout: float) -> list[int]:
        """The pids of `machine`'s workers, from its next heartbeat with all of them
        running (to freeze or kill them as a fault)."""
        found: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()

        async def on_beat(msg: Msg) -> None:
            beat = decode(Heartbeat, msg.data)
            pids = [w.pid for w in beat.workers if w.pid is not None and w.state == "running"]
            if pids and len(pids) == len(beat.workers) and not found.done():
                found.set_result(pids)

        sub = await self.nc.subscribe(JobSubjects(self.job).heartbeat(machine), cb=on_beat)
        try:
            return await asyncio.wait_for(found, timeout)
        finally:
            await sub.unsubscribe()

    def mismatches(self, reference: dict[str, Path], step: int | None = None) -> list[str]:
        """Differences between this run's saved states after `step` (by default the
        job's last) and `reference`'s."""
        step = self.config.train.steps if step is None else step
        run = self.stack.run_dir
        return mismatches(state_files(run, step), reference, skipped_roles(run, step))
