"""The sidecar: one per machine, between the bus and the machine's worker processes.

- launches the workers (with the machine's role from the cluster state, or as standbys);
- answers the executor's commands (`tm.<job>.cmd.<machine>`, idempotent by command id)
  by relaying them to the workers over the runtime's control API;
- publishes a heartbeat every interval (and at once when a worker exits) and the step
  statistics of its ranks;
- after its workers left in a migration, keeps the machine in maintenance for the
  configured time, then relaunches them as a standby, as a drained node returns;
- when the planner declared the machine failed (`fence`), kills its workers at once and
  relaunches them as a fresh standby: two machines never both hold a role.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.js.errors import KeyNotFoundError

from trainmover import bus, metric_names
from trainmover.bus.clusterstate import follow_states, read_state
from trainmover.bushealth import BusHealth, degraded_gauge
from trainmover.httpserver import HttpServer, serve_observability
from trainmover.logs import get_logger
from trainmover.messages import (
    ClusterState,
    CollectiveErrorReport,
    Command,
    Heartbeat,
    Plan,
    StallReport,
    StepStats,
    new_id,
)
from trainmover.metrics import Registry
from trainmover.planwire import plan_of
from trainmover.runtime import control as c
from trainmover.runtime.config import JobConfig, records_on_the_bus
from trainmover.runtime.launcher import REFERENCE_ENTRY
from trainmover.runtime.plan import RankRef
from trainmover.service import write_port_file
from trainmover.services.executor.fencing import fenced_in
from trainmover.services.sidecar.workers import WORKER_OPS, MachineWorkers
from trainmover.subjects import JobSubjects
from trainmover.tasks import cancel_and_wait

log = get_logger("sidecar")

#: Seconds between a sidecar's direct reads of its job's cluster state while its watch
#: is quiet (`bus.follow`).
SIDECAR_STATE_CHECK_S = 5.0

#: Seconds before a failed warm-up is tried again, doubling up to the second value: a
#: cause that passes (the bus back) is soon over, one that stays is not retried in a loop.
WARM_RETRY_FIRST_S, WARM_RETRY_MAX_S = 2.0, 60.0


@dataclass
class SidecarSettings:
    nats_url: str
    config: JobConfig
    machine: str
    rendezvous: str
    run_dir: Path | None = None
    entry: str = REFERENCE_ENTRY
    heartbeat_interval_s: float = 0.5
    command_timeout_s: float = 120.0
    http_host: str = "127.0.0.1"
    http_port: int = 0
    port_file: Path | None = None
    log_format: str | None = None
    log_level: str | None = None


class Sidecar:
    """One machine's sidecar; `start()` connects, launches the workers and serves."""

    def __init__(self, settings: SidecarSettings, nc: NatsClient | None = None) -> None:
        self.s = settings
        self.job = settings.config.job
        self.machine = settings.machine
        self._subjects = JobSubjects(self.job)
        self._nc = nc
        self._state: ClusterState | None = None
        self._status = "standby"
        self._warm_types: list[str] = []
        #: The incarnation of this machine's workers, new at every launch: the planner
        #: takes a released or failed machine back only from a new one.
        self._instance = new_id()
        self._fenced = ""  # the instance whose workers were fenced (once each)
        self._seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._server: bus.CommandServer | None = None
        self._http: HttpServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat_now = asyncio.Event()
        run_dir = settings.run_dir or Path(tempfile.mkdtemp(prefix=f"tm-{self.machine}-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        self.workers = MachineWorkers(
            self.machine,
            records_on_the_bus(settings.config, settings.nats_url),
            run_dir,
            settings.rendezvous,
            lambda: self._state,
            settings.entry,
            settings.command_timeout_s,
        )
        self.workers.tracker.listeners.append(self._on_worker_event)
        self.metrics = Registry()
        self._m_commands = self.metrics.counter(
            metric_names.SIDECAR_COMMANDS,
            "Commands handled, by op and outcome",
            ["op", "outcome"],
        )
        self._m_steps = self.metrics.gauge(metric_names.SIDECAR_STEP, "Last step of the machine")
        # One per machine: a probe every few seconds keeps a large job's probes light
        # on the stream leader.
        self._bus_health = BusHealth(
            f"sidecar-{self.machine}", degraded_gauge(self.metrics), [self.job], every_s=5.0
        )

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._nc is None:
            self._nc = await bus.connect(self.s.nats_url, f"sidecar-{self.machine}")
        self._state = await self._wait_for_state()
        self._tasks.append(asyncio.create_task(self._watch_state()))
        self._tasks.append(asyncio.create_task(self._bus_health.watch(self._nc)))
        self._server = bus.CommandServer(self._nc, self.job, self.machine, self._handle)
        await self._server.start()
        self._status = "active" if self._assigned() else "standby"
        self._tasks.append(asyncio.create_task(self._heartbeats()))
        await asyncio.to_thread(self.workers.launch)
        if self._status == "standby":
            self._tasks.append(asyncio.create_task(self._warm_quietly()))
        self._http = await serve_observability(
            self.metrics, self._health, self.s.http_host, self.s.http_port
        )
        write_port_file(self.s.port_file, self._http.port)
        log.info(
            "sidecar_started",
            job=self.job,
            machine=self.machine,
            status=self._status,
            run_dir=str(self.workers.run_dir),
            http_port=self._http.port,
        )

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
        await cancel_and_wait(self._tasks, owner="sidecar")
        await asyncio.to_thread(self.workers.close)
        if self._http is not None:
            await self._http.stop()
        if self._nc is not None and self._nc.is_connected:
            with contextlib.suppress(Exception):
                await self._nc.flush(timeout=2)
            await self._nc.close()
        log.info("sidecar_stopped", job=self.job, machine=self.machine)

    def _health(self) -> dict[str, object]:
        connected = self._nc is not None and self._nc.is_connected
        return {
            "status": "ok" if connected else "bus_disconnected",
            "machine": self.machine,
            "machine_status": self._status,
            "bus_degraded": self._bus_health.degraded,
        }

    def _assigned(self) -> bool:
        mine = self._state.machines.get(self.machine) if self._state else None
        return mine is not None and mine.cell is not None and mine.status == "active"

    # --- cluster state -------------------------------------------------------------------

    async def _wait_for_state(self) -> ClusterState:
        """The planner writes the job's state when it registers it; wait for that."""
        assert self._nc is not None
        js = self._nc.jetstream()
        while True:
            try:
                state = await read_state(await bus.job_bucket(js, self.job))
                if state is not None:
                    return state
            except Exception as err:  # bucket or key not there yet
                if not isinstance(err, KeyNotFoundError):
                    log.debug("waiting_for_state", job=self.job, error=str(err))
            await asyncio.sleep(0.1)

    async def _watch_state(self) -> None:
        assert self._nc is not None
        kv = await bus.job_bucket(self._nc.jetstream(), self.job)
        # One sidecar per machine reads the key while its watch is quiet: every few
        # seconds, not every second, so that a large job's sidecars do not load the
        # bucket's leader (the executor's fence command reaches a live sidecar first).
        async for state in follow_states(kv, check_s=SIDECAR_STATE_CHECK_S):
            if state:
                self._state = state
                if self._state is not None and fenced_in(self._state, self.machine, self._instance):
                    # The executor's fence may never have reached us (cut off meanwhile).
                    await self._fence(self._instance)

    # --- signals -------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        assert self._nc is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.s.heartbeat_interval_s)
            self._beat_now.clear()
            workers = self.workers.worker_status()
            warm: list[str] = []
            if self._status == "standby" and workers and all(w.state == "standby" for w in workers):
                warm = self._warm_types
            beat = Heartbeat(
                job=self.job,
                machine=self.machine,
                seq=self._seq,
                status=self._status,  # type: ignore[arg-type]
                workers=workers,
                warm_role_types=warm,
                instance=self._instance,
            )
            self._seq += 1
            with contextlib.suppress(Exception):
                await self._nc.publish(self._subjects.heartbeat(self.machine), beat.to_json())

    def _on_worker_event(self, ref: RankRef, msg: c.Message) -> None:
        """Runs on a control reader thread: hand work to the event loop."""
        if self._loop is None:
            return
        if isinstance(msg, c.StepDone) and ref.local_rank == 0:
            self._loop.call_soon_threadsafe(self._publish_stats, msg)
        elif isinstance(msg, c.Exited):
            self._loop.call_soon_threadsafe(self._beat_now.set)
        elif isinstance(msg, c.CollectiveErrorEvent):
            self._loop.call_soon_threadsafe(self._report_collective_error, msg)
        elif isinstance(msg, c.StallEvent):
            self._loop.call_soon_threadsafe(self._report_stall, msg)

    def _publish_soon(self, subject: str, payload: bytes) -> None:
        """A plain publish from the event loop, not waited for: a signal lost with the
        connection is not worth holding a worker's event for."""
        assert self._nc is not None
        task = asyncio.ensure_future(self._nc.publish(subject, payload))
        task.add_done_callback(lambda t: t.exception())

    def _report_collective_error(self, error: c.CollectiveErrorEvent) -> None:
        """A rank's collective failed: tell the health-monitor whom it blames."""
        assert self._nc is not None
        report = CollectiveErrorReport(
            job=self.job,
            machine=self.machine,
            peer=error.peer_machine or self.machine,
            group=error.group,
            error=error.error[:4000],
        )
        log.warning(
            "collective_error",
            job=self.job,
            machine=self.machine,
            peer=error.peer_machine,
            group=error.group,
            error=error.error[:200],
        )
        if error.peer_machine is None:
            return  # nobody to blame: the heartbeats will tell who died
        self._publish_soon(self._subjects.collective_error(self.machine), report.to_json())

    def _report_stall(self, stall: c.StallEvent) -> None:
        """A rank of this machine names the machines holding a step back."""
        assert self._nc is not None
        report = StallReport(
            job=self.job,
            machine=self.machine,
            epoch=stall.epoch,
            step=stall.step,
            culprits=stall.culprits,
            silent=stall.silent,
            reason=stall.reason[:4000],
            waited_s=stall.waited_s,
            median_step_s=stall.median_step_s,
        )
        log.warning("step_held_back", job=self.job, machine=self.machine, reason=report.reason)
        self._publish_soon(self._subjects.stall(self.machine), report.to_json())

    def _publish_stats(self, done: c.StepDone) -> None:
        assert self._nc is not None
        self._m_steps.set(done.step)
        # Compute time without the waits in collectives: a machine waiting on a slow
        # peer must not look slow itself.
        compute = done.compute_s if done.compute_s is not None else done.seconds
        stats = StepStats(
            job=self.job,
            machine=self.machine,
            step=done.step,
            compute_s=compute,
            queued_s=done.queued_s,
            vote_s=done.vote_s,
            ts=done.t_end,  # when the step ended, not when this loop got to it
        )
        self._publish_soon(self._subjects.stats(self.machine), stats.to_json())

    # --- commands --------------------------------------------------------------------------

    async def _handle(self, command: Command) -> dict[str, object]:
        log.info(
            "command",
            job=self.job,
            machine=self.machine,
            op=command.op,
            plan_id=command.plan_id,
            command_id=command.command_id,
        )
        timeout = float(command.args.get("timeout_s", self.s.command_timeout_s))
        try:
            result = await self._dispatch(command, timeout)
        except Exception:
            self._m_commands.labels(op=command.op, outcome="error").inc()
            raise
        self._m_commands.labels(op=command.op, outcome="ok").inc()
        return result

    async def _dispatch(self, command: Command, timeout: float) -> dict[str, object]:
        """The sidecar's own ops here; every other op is the workers' (`handle`)."""
        w = self.workers
        op = command.op
        if op == "warm":
            return await self._warm(timeout)
        if op == "fence":
            return await self._fence(str(command.args.get("instance") or ""))
        if op == "release":
            return await self._release(plan_of(command), timeout)
        if op == "abort":
            return self._abort(plan_of(command))
        if op not in WORKER_OPS:
            raise ValueError(f"unsupported op {op!r}")
        if op in ("prepare", "recover") and self._status == "standby" and not self._warm_types:
            # A standby is told these only as a joiner, and the planner takes only warm
            # standbys: the plan was made for an earlier launch of this machine (a
            # command retried across its relaunch).
            raise ValueError(
                f"{self.machine} is a standby not warm (yet): not the launch this plan was made for"
            )
        if op == "prepare" and any(m.leaver == self.machine for m in plan_of(command).moves):
            self._status = "leaving"
        result = await asyncio.to_thread(w.handle, command, timeout)
        if op == "status":
            result |= {"status": self._status, "instance": self._instance,
                       "workers": [x.model_dump() for x in w.worker_status()]}  # fmt: skip
        if op == "transfer" and "joiner" in result["parts"]:  # type: ignore[operator]
            self._status = "active"
        return result

    async def _warm(self, timeout: float) -> dict[str, object]:
        """Shadow iterations for every role type of the job; the heartbeat then offers the
        machine to the planner as warm for them."""
        types: list[str] = list(self.s.config.layout.role_types())
        result = await asyncio.to_thread(self.workers.warm, types, timeout)
        self._warm_types = list(result["role_types"])  # type: ignore[call-overload]
        self._beat_now.set()
        if result["errors"]:
            log.warning("warm_up_failed", job=self.job, machine=self.machine, **result)
        else:
            log.info("standby_warm", job=self.job, machine=self.machine, **result)
        return result

    async def _warm_quietly(self) -> None:
        """A standby warms up as soon as its workers are up. Workers that are alive but
        slow (each imports torch; a loaded host takes minutes) are waited for again, and a
        warm-up that failed (its recordings unreadable while the bus was away, say) is
        tried again after a growing pause, as long as these workers are a standby:
        giving up would leave a healthy standby cold, out of the pool for good. Workers
        that died leave it cold, logged with the reason."""
        instance, pause = self._instance, WARM_RETRY_FIRST_S
        while self._instance == instance and self._status == "standby":
            try:
                result = await self._warm(self.s.command_timeout_s)
            except TimeoutError as err:
                if not self.workers.running():
                    log.error("warm_up_failed", job=self.job, machine=self.machine, error=str(err))
                    return
                log.warning(
                    "warm_up_slow",
                    job=self.job,
                    machine=self.machine,
                    reason=f"{err}; its workers are alive, waiting again",
                )
                continue
            except Exception as err:
                log.error("warm_up_failed", job=self.job, machine=self.machine, error=str(err))
                return
            if not result["errors"] or result["role_types"]:
                return  # warm (for some types, maybe): the planner may pick it already
            log.info("warm_up_retry", job=self.job, machine=self.machine, retry_in_s=pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, WARM_RETRY_MAX_S)

    async def _release(self, plan: Plan, timeout: float) -> dict[str, object]:
        """After the leaver's switch: its workers exit, maintenance, then back as a standby."""
        if not any(m.leaver == self.machine for m in plan.moves):
            return {"released": False}
        await asyncio.to_thread(self.workers.wait_exited, timeout)
        self._status = "maintenance"
        self._beat_now.set()
        self._tasks.append(asyncio.create_task(self._return_after_maintenance()))
        return {"released": True, "maintenance_s": self.s.config.cluster.maintenance_s}

    def _abort(self, plan: Plan) -> dict[str, object]:
        """The planner withdrew `plan` half way (a recovery superseded it). This machine's
        workers, as its joiner, may hold the role already and cannot give it back: they are
        relaunched as a standby (through maintenance, so the planner does not take the
        machine until it is warm again). As a leaver it keeps its role."""
        if any(m.joiner == self.machine for m in plan.moves) and self._status != "active":
            self._status = "maintenance"
            self._warm_types = []
            self._beat_now.set()
            self._tasks.append(asyncio.create_task(self._relaunch_as_standby()))
            return {"relaunched": True}
        if any(m.leaver == self.machine for m in plan.moves) and self._status == "leaving":
            self._status = "active"
            self._beat_now.set()
        return {"relaunched": False, "status": self._status}

    async def _fence(self, instance: str) -> dict[str, object]:
        """The planner declared this machine failed: its role trains elsewhere now. Its
        workers are killed at once (SIGKILL ends a hung or stopped process too), and the
        machine comes back only as a fresh standby (a new instance). A fence meant for
        an earlier instance (a late or repeated command) leaves the current one alone."""
        if instance and instance != self._instance:
            return {"fenced": False, "instance": self._instance, "reason": "a newer instance"}
        if self._fenced == self._instance:
            return {"fenced": True, "instance": self._instance}  # already: a second word
        fenced = self._fenced = self._instance
        self._status = "maintenance"
        self._warm_types = []
        self._beat_now.set()
        await asyncio.to_thread(self.workers.kill)
        log.warning("fenced", job=self.job, machine=self.machine, instance=fenced)
        self._tasks.append(asyncio.create_task(self._relaunch_as_standby()))
        return {"fenced": True, "instance": fenced}

    async def _return_after_maintenance(self) -> None:
        await asyncio.sleep(self.s.config.cluster.maintenance_s)
        await self._relaunch_as_standby()

    async def _relaunch_as_standby(self) -> None:
        await asyncio.to_thread(self.workers.stop)
        self._instance = new_id()
        await asyncio.to_thread(self.workers.launch, True)
        self._status = "standby"
        self._warm_types = []
        self._beat_now.set()
        log.info("back_from_maintenance", job=self.job, machine=self.machine)
        await self._warm_quietly()
