"""One size of `trainmover bench control-plane`: a job of N simulated machines against the
real planner, executor and health-monitor on a 3-server JetStream cluster, measured.

The stack is `trainmover up`'s (`trainmover.stack.Stack`: the services as their own
processes, `--nats-cluster 3`), without its local cluster: the machines are simulated
(`simhost`), and the status page runs in a process of its own (`pagehost`). The job is
TP8 x PP x DP (8 ranks a machine), with 1 % of its machines as standbys (at least one).
In order: start-up until every machine is admitted, a steady window (each process's CPU
and memory, the bus's messages), the cluster state's size and update cost, `trainmover
status` and the status page, then `reps` times a drain and a failure (a machine silenced),
each timed from the bus: event, plan, end, and the commands the machines answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

from trainmover import bus
from trainmover.bench.control_plane_probe import (
    Observer,
    PageHost,
    cpu_between,
    cpu_of,
    newest_states,
    state_costs,
    status_cli_s,
    varz,
    workers_busy_s,
)
from trainmover.bench.memory import rss_bytes
from trainmover.bench.report import Progress, Result
from trainmover.bench.simhost import SimHosts
from trainmover.bench.simmachine import SimTiming
from trainmover.client import TrainMoverClient
from trainmover.messages import ClusterState
from trainmover.runtime.config import ClusterConfig, JobConfig, ModelConfig, save_config
from trainmover.runtime.layout import Layout
from trainmover.stack import STACK_SERVICES, Stack
from trainmover.tasks import cancel_and_wait

TP = 8
#: Simulated machines per host process.
MACHINES_PER_HOST = 1024


def job_config(machines: int, pp: int, maintenance_s: float) -> JobConfig:
    """TP8 x PP x DP on `machines` machines, standbys 1 % of them (at least one)."""
    if machines % pp:
        raise ValueError(f"{machines} machines do not divide into {pp} pipeline stages")
    standbys = [f"s{i}" for i in range(max(1, machines // 100))]
    return JobConfig(
        job=f"cp{machines}",
        layout=Layout(tp=TP, pp=pp, dp=machines // pp),
        model=ModelConfig(n_heads=TP, d_model=64, n_layers=pp),
        cluster=ClusterConfig(standbys=standbys, maintenance_s=maintenance_s),
    )


def _ready(config: JobConfig) -> Any:
    """Every active machine's instance known and every standby in the pool, warm."""

    def ready(state: ClusterState) -> bool:
        machines = state.machines
        return all(
            machines.get(m) is not None and machines[m].instance for m in config.cluster.machines
        ) and all(
            getattr(machines.get(s), "status", "") == "standby" and machines[s].warm_role_types
            for s in config.cluster.standbys
        )

    return ready


def _quiet(state: ClusterState) -> bool:
    """Nothing in flight or queued, and a warm standby free."""
    return (
        not state.in_flight
        and not state.queued
        and any(m.status == "standby" and m.warm_role_types for m in state.machines.values())
    )


def log_cause(log_dir: Path) -> str:
    """Per service, what it logged that a failed size is blamed on: how often its bus
    connection was dropped, and its last error (event and reason). Its log is read line
    by line: at thousands of machines a monitor's log grows by gigabytes."""
    found = []
    for name in STACK_SERVICES:
        path = log_dir / f"{name}.log"
        if not path.exists():
            continue
        drops, last = 0, ""
        with path.open(errors="replace") as lines:
            for line in lines:
                if '"nats_disconnected"' in line:
                    drops += 1
                elif '"level": "error"' in line or line.startswith("Traceback"):
                    last = line
        if last.startswith("{"):
            with contextlib.suppress(ValueError):
                doc = json.loads(last)
                why = doc.get("reason") or doc.get("error") or ""
                last = f"{doc.get('event')} ({str(why)[:200]})"
        if drops or last:
            found.append(f"{name}: {drops} bus disconnects, last error {last.strip()[:300] or '-'}")
    return "; ".join(found)


class SizeRun:
    """The measurements of one size into `result` under `prefix` (see the module doc)."""

    def __init__(
        self, machines: int, args: argparse.Namespace, run_dir: Path, result: Result,
        progress: Progress,
    ) -> None:  # fmt: skip
        self.n, self.args, self.run_dir, self.result = machines, args, run_dir, result
        self.progress = progress
        self.prefix = f"sizes.{machines}"
        self.config = job_config(machines, args.pp, args.maintenance)
        self.job = self.config.job
        self.timing = SimTiming(step_s=args.step, switch_s=args.switch_ms / 1e3)
        self.rng = random.Random(args.seed + machines)
        self.moved: set[str] = set()
        self.silenced: set[str] = set()
        self.migrations: list[dict[str, Any]] = []

    def set(self, key: str, value: Any, reason: str | None = None) -> None:
        self.result.set(f"{self.prefix}.{key}", value, reason)

    async def run(self) -> None:
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        path = save_config(self.config, self.run_dir / "job.json")
        layout = self.config.layout
        self.set("gpus", self.n * TP)
        self.set("layout", f"TP{layout.tp} x PP{layout.pp} x DP{layout.dp}")
        self.set("standbys", len(self.config.cluster.standbys))
        async with Stack(
            job_config=str(path), nats_cluster=3, cluster=False, run_dir=self.run_dir,
            log_dir=log_dir, services=list(STACK_SERVICES),
        ) as stack:  # fmt: skip
            # Nothing restarts a service here: one that dies ends the size, named.
            measure = asyncio.create_task(self._measure(stack, path, log_dir))
            died = asyncio.create_task(stack.first_exit())
            await asyncio.wait({measure, died}, return_when=asyncio.FIRST_COMPLETED)
            if not measure.done():
                await cancel_and_wait([measure], owner="bench control-plane", timeout_s=60)
                name, code = died.result()
                raise RuntimeError(f"the {name} exited with code {code}")
            died.cancel()
            measure.result()

    async def _measure(self, stack: Stack, path: Path, log_dir: Path) -> None:
        assert stack.nats_cluster is not None
        monitors = [node.ports["monitoring"][0] for node in stack.nats_cluster.nodes]
        nc = await bus.connect(stack.url, "bench-control-plane")
        observer = Observer(nc, self.job)
        await observer.start()
        hosts_n = math.ceil(self.n / MACHINES_PER_HOST)
        self.set("sim_hosts", hosts_n)
        started = time.monotonic()
        hosts = await SimHosts.start(stack.url, path, hosts_n, time.time(), self.timing,
                                     log_dir, self.args.timeout)  # fmt: skip
        page: PageHost | None = None
        try:
            page = await PageHost.start(stack.url, self.job, log_dir / "status-page.log",
                                        self.args.timeout)  # fmt: skip
            state = await self._state(nc, _ready(self.config), "every machine admitted")
            self.set("startup_s", time.monotonic() - started)
            self.set("startup_revisions", state.revision)
            self.progress.note(
                f"{self.n} machines: all admitted in {time.monotonic() - started:.1f} s "
                f"({state.revision} state revisions)"
            )
            pids = {**stack.pids(), "status-page": page.proc.pid}
            pids |= {f"simhost-{i}": pid for i, pid in enumerate(hosts.pids)}
            await self._steady(pids, monitors)
            await self._state_and_status(nc, stack.url, page)
            client = TrainMoverClient(nc)  # not its context: it would close `nc`
            for rep in range(self.args.reps):
                for kind in ("drain", "failure"):
                    await self._migration(kind, rep, nc, client, observer, hosts, pids)
        finally:
            self.set("migrations", self.migrations)
            # Failure events of machines nobody silenced: the monitor's false alarms.
            failed = {e.message.machine for e in observer.events if e.message.kind == "failure"}
            self.set("spurious_failures", sorted(failed - self.silenced))
            if page is not None:
                await page.stop()
            await hosts.stop()
            await observer.stop()
            await nc.close()

    async def _state(self, nc: Any, predicate: Any, what: str) -> ClusterState:
        async def first() -> ClusterState:
            async for state in newest_states(nc, self.job):
                if predicate(state):
                    return state
            raise RuntimeError(f"{what}: the state's watch ended")

        try:
            return await asyncio.wait_for(first(), self.args.timeout)
        except TimeoutError:
            raise TimeoutError(f"{what}: not within {self.args.timeout:.0f} s") from None

    async def _steady(self, pids: dict[str, int], monitors: list[str]) -> None:
        """Training with nothing happening: CPU cores per process, memory, the bus."""
        window = self.args.window
        cpu0, bus0, t0 = cpu_of(pids), await asyncio.to_thread(varz, monitors), time.monotonic()
        await asyncio.sleep(window)  # the window measured, not a wait for anything
        cpu1, bus1, dt = (
            cpu_of(pids),
            await asyncio.to_thread(varz, monitors),
            time.monotonic() - t0,
        )
        cores = {name: used / dt for name, used in cpu_between(cpu0, cpu1).items()}
        self.set("cpu_cores", cores)
        self.set("rss_mib", {name: (rss_bytes(pid) or 0) / 2**20 for name, pid in pids.items()})
        self.set("bus_in_msgs_per_s", (bus1["in_msgs"] - bus0["in_msgs"]) / dt)
        self.set("bus_out_msgs_per_s", (bus1["out_msgs"] - bus0["out_msgs"]) / dt)
        self.set("bus_in_mb_per_s", (bus1["in_bytes"] - bus0["in_bytes"]) / dt / 1e6)
        services = ", ".join(f"{n} {cores[n]:.2f}" for n in STACK_SERVICES)
        self.progress.step(
            f"{self.n} machines: steady CPU cores {services}; bus "
            f"{(bus1['in_msgs'] - bus0['in_msgs']) / dt:.0f} msgs/s in"
        )

    async def _state_and_status(self, nc: Any, url: str, page: PageHost) -> None:
        costs = await state_costs(nc, self.job)
        self.set("state", costs)
        self.set("state_bytes", costs["bytes"])
        self.set("state_put_s", costs["put_s"])
        cli = [await status_cli_s(url, self.job) for _ in range(3)]
        self.result.set_median(f"{self.prefix}.status_cli_s", cli)
        answers = [await page.answer_s() for _ in range(5)]
        self.result.set_median(f"{self.prefix}.status_page_s", answers)
        self.progress.note(
            f"{self.n} machines: cluster state {costs['bytes'] / 1e3:.0f} kB, a write "
            f"{1e3 * costs['put_s']:.1f} ms; trainmover status {statistics.median(cli):.2f} s, "
            f"status page {1e3 * statistics.median(answers):.0f} ms"
        )

    async def _migration(
        self, kind: str, rep: int, nc: Any, client: TrainMoverClient, observer: Observer,
        hosts: SimHosts, pids: dict[str, int],
    ) -> None:  # fmt: skip
        state = await self._state(nc, _quiet, f"a free standby before {kind} {rep + 1}")
        active = sorted(n for n, m in state.machines.items() if m.status == "active")
        machine = self.rng.choice([m for m in active if m not in self.moved] or active)
        self.moved.add(machine)
        cpu0 = cpu_of(pids)
        row: dict[str, Any] = {"kind": kind, "rep": rep, "machine": machine}
        timeout = self.args.timeout
        if kind == "drain":
            event_id = await client.drain(self.job, machine, reason="bench control-plane")
            event = await observer.wait(
                lambda: next((e for e in observer.events if e.message.event_id == event_id), None),
                timeout, f"drain event for {machine}",
            )  # fmt: skip
        else:
            self.silenced.add(machine)
            silenced = await hosts.silence(machine)
            event = await observer.wait(
                lambda: observer.event_for(machine, "failure", silenced),
                timeout, f"failure event for the silenced {machine}",
            )  # fmt: skip
            row["detect_s"] = event.at - silenced
            row["source"] = event.message.source
        event_id = event.message.event_id
        plan = await observer.wait(lambda: observer.plan_for(event_id), timeout, f"plan for {kind}")
        end = await observer.wait(lambda: observer.end_of(event_id), timeout, f"end of {kind}")
        cpu = cpu_between(cpu0, cpu_of(pids))
        if kind == "failure":
            await hosts.revive(machine)  # repaired: back as a fresh standby
        records = await hosts.records([plan.message.plan_id])
        ops: dict[str, int] = {}
        for r in records:
            ops[r.op] = ops.get(r.op, 0) + 1
        busy = workers_busy_s(records, event.at, end.at)
        row |= {
            "event_id": event_id,
            "plan_id": plan.message.plan_id,
            "migration": plan.message.migration,
            "affected": len(plan.message.affected_machines()),
            "plan_bytes": len(plan.message.model_dump_json()),
            "end_state": end.message.state,
            "event_to_plan_s": plan.at - event.at,
            "plan_to_end_s": end.at - plan.at,
            "last_reply_after_plan_s": max((r.replied for r in records), default=plan.at) - plan.at,
            "workers_busy_s": busy,
            "control_plane_s": end.at - event.at - busy,
            "commands": ops,
            "commands_failed": sum(not r.ok for r in records),
            "cpu_s": cpu,
        }
        self.migrations.append(row)
        if end.message.state != "done":
            raise RuntimeError(
                f"{kind} of {machine} ended {end.message.state}: {end.message.detail}"
            )
        detect = f"silent->event {row['detect_s']:.2f} s, " if kind == "failure" else ""
        self.progress.step(
            f"{self.n} machines: {kind} {rep + 1} of {machine}: {detect}event->plan "
            f"{1e3 * row['event_to_plan_s']:.0f} ms, plan->end {row['plan_to_end_s']:.2f} s "
            f"({sum(ops.values())} commands; control plane {1e3 * row['control_plane_s']:.0f} ms)"
        )
