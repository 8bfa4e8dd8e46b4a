"""The faults of the chaos soak: each one injects itself into a local cluster and says
what the system must do about it (an `Injection`), which the soak then waits for.

Kinds (FAULT_KINDS):
- worker_kill: SIGKILL of one worker process of an active machine;
- machine_kill: SIGKILL of an active machine's sidecar and workers at once;
- planner_kill / executor_kill: a drain, and the service SIGKILLed (and restarted by the
  stack) once the plan is out / once phase 1 started;
- drain: a planned migration through the client;
- straggler: one active machine made slow (sidecar op "slow") until the health-monitor
  flags it and the planner moves it;
- standby_dies: a drain, and its joiner (a standby) killed during phase 1;
- leaver_dies: a drain, and its leaver killed during phase 1 (the planner must switch to
  the unplanned path);
- nats_restart: the nats-server crashes (SIGKILL) and restarts on its port with its
  JetStream state; half the time while a drain is in phase 1;
- nats_node_kill (with `--nats-cluster N`): one server of the cluster SIGKILLed and
  restarted with its state once recovered; half the time the leader of the job's EVENTS
  stream or the meta leader, and half the time while a drain is in phase 1;
- store_kill: the serving replica of the rendezvous store SIGKILLed (the stack starts
  it again; the soak runs two replicas); half the time while a drain is in phase 1.

Killed machines are restarted as fresh standbys by the soak once the planner has let
them go (they rejoin the pool after warming up), as a repaired node would.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from trainmover import bus
from trainmover.chaos.observer import Observer
from trainmover.localcluster import LocalCluster
from trainmover.messages import Command, MigrationProgress
from trainmover.subjects import JobSubjects

FAULT_KINDS = (
    "worker_kill",
    "machine_kill",
    "planner_kill",
    "executor_kill",
    "drain",
    "straggler",
    "standby_dies",
    "leaver_dies",
    "nats_restart",
    "nats_node_kill",
    "store_kill",
)

#: The faults a bus of one server allows (every kind but a cluster node's).
SINGLE_SERVER_KINDS = tuple(k for k in FAULT_KINDS if k != "nats_node_kill")


def default_kinds(nats_cluster: int) -> tuple[str, ...]:
    """Every fault kind the bus allows: nats_node_kill only on a cluster."""
    return FAULT_KINDS if nats_cluster >= 3 else SINGLE_SERVER_KINDS


TERMINAL = ("done", "failed", "aborted", "rejected")


@dataclass
class Injection:
    """One injected fault and what recovery means for it."""

    kind: str
    target: str | None
    detail: str
    #: Machines that must no longer be active once recovered.
    left: set[str] = field(default_factory=set)
    #: Machines killed: restart them as fresh standbys once the planner let them go.
    killed: set[str] = field(default_factory=set)
    #: Events whose migration must have ended (any terminal state).
    events: list[str] = field(default_factory=list)
    #: Bus servers killed: restart them with their state once recovered.
    bus_nodes: set[int] = field(default_factory=set)


@dataclass
class FaultContext:
    cluster: LocalCluster
    observer: Observer
    rng: random.Random
    timeout_s: float

    async def active(self) -> list[str]:
        state = await self.observer.state()
        return sorted(n for n, m in state.machines.items() if m.status == "active")

    async def pick_active(self) -> str:
        return self.rng.choice(await self.active())

    async def drain(self, machine: str, reason: str) -> str:
        return await self.cluster.client.drain(self.cluster.job, machine, reason=reason)

    async def reaches(self, event_id: str, states: tuple[str, ...]) -> MigrationProgress:
        """Until the event's migration reached one of `states` (or ended)."""

        async def check() -> MigrationProgress | None:
            for p in self.observer.progress_of(event_id):
                if p.state in states or p.state in TERMINAL:
                    return p
            return None

        return await self.observer.until(check, self.timeout_s, f"{event_id[:8]} in {states}")

    async def command(self, machine: str, op: str, **args: object) -> dict[str, object]:
        reply = await bus.request(
            self.cluster.nc,
            Command(job=self.cluster.job, machine=machine, op=op, args=args),  # type: ignore[arg-type]
            timeout=10,
            deadline_s=self.timeout_s,
        )
        if not reply.ok:
            raise RuntimeError(f"{op} on {machine}: {reply.error}")
        return reply.result


Inject = Callable[[FaultContext], Awaitable[Injection]]


async def worker_kill(ctx: FaultContext) -> Injection:
    target = await ctx.pick_active()
    status = await ctx.command(target, "status")
    # Any live worker: a machine that joined in a migration reports its workers by their
    # launch state, not "running".
    pids = [w["pid"] for w in status["workers"] if w["state"] != "exited"]  # type: ignore[attr-defined, index]
    pid = int(ctx.rng.choice(pids))
    os.kill(pid, signal.SIGKILL)
    return Injection("worker_kill", target, f"SIGKILL worker pid {pid}", {target}, {target})


async def machine_kill(ctx: FaultContext) -> Injection:
    target = await ctx.pick_active()
    ctx.cluster.stack.kill_machine(target)
    return Injection("machine_kill", target, "SIGKILL sidecar and workers", {target}, {target})


async def _drain_then(
    ctx: FaultContext,
    kind: str,
    at: tuple[str, ...],
    then: Callable[[MigrationProgress], Awaitable[str]],
) -> Injection:
    target = await ctx.pick_active()
    event_id = await ctx.drain(target, f"chaos {kind}")
    progress = await ctx.reaches(event_id, at)
    if progress.state in TERMINAL:
        detail = f"drain ended {progress.state} before {at[0]}: {progress.detail}"
        return Injection(kind, target, detail, {target}, events=[event_id])
    detail = await then(progress)
    return Injection(kind, target, detail, {target}, events=[event_id])


async def planner_kill(ctx: FaultContext) -> Injection:
    async def kill(_: MigrationProgress) -> str:
        await ctx.cluster.stack.restart_service("planner")
        return "drain, planner SIGKILLed once its plan was out"

    return await _drain_then(ctx, "planner_kill", ("planned",), kill)


async def executor_kill(ctx: FaultContext) -> Injection:
    async def kill(_: MigrationProgress) -> str:
        await ctx.cluster.stack.restart_service("executor")
        return "drain, executor SIGKILLed in phase 1"

    return await _drain_then(ctx, "executor_kill", ("phase1",), kill)


async def drain(ctx: FaultContext) -> Injection:
    target = await ctx.pick_active()
    event_id = await ctx.drain(target, "chaos drain")
    return Injection("drain", target, "drain through the client", {target}, events=[event_id])


async def straggler(ctx: FaultContext) -> Injection:
    target = await ctx.pick_active()
    extra = max(0.4, 3 * ctx.observer.step_time())
    seen = len(ctx.observer.stragglers)
    await ctx.command(target, "slow", extra_s=extra)

    async def flagged() -> str | None:
        for event in ctx.observer.stragglers[seen:]:
            if event.machine == target:
                return event.event_id
        return None

    event_id = await ctx.observer.until(flagged, ctx.timeout_s, f"a straggler event for {target}")
    outcome = await ctx.reaches(event_id, ("planned",))
    if outcome.state == "rejected":
        # Not moved (cool-down, no standby): it is only slow; make it normal again.
        await ctx.command(target, "slow", extra_s=0.0)
        return Injection("straggler", target, f"+{extra:.2f}s/step, {outcome.detail}")
    return Injection(
        "straggler", target, f"+{extra:.2f}s/step, flagged and moved", {target}, events=[event_id]
    )


async def standby_dies(ctx: FaultContext) -> Injection:
    killed: set[str] = set()

    async def kill(progress: MigrationProgress) -> str:
        assert progress.joiner is not None
        ctx.cluster.stack.kill_machine(progress.joiner)
        killed.add(progress.joiner)
        return f"drain, joiner {progress.joiner} SIGKILLed in phase 1"

    injection = await _drain_then(ctx, "standby_dies", ("phase1",), kill)
    injection.killed = killed
    return injection


async def leaver_dies(ctx: FaultContext) -> Injection:
    async def kill(progress: MigrationProgress) -> str:
        assert progress.leaver is not None
        ctx.cluster.stack.kill_machine(progress.leaver)
        return "drain, leaver SIGKILLed in phase 1"

    injection = await _drain_then(ctx, "leaver_dies", ("phase1",), kill)
    injection.killed = set(injection.left)
    return injection


async def nats_restart(ctx: FaultContext) -> Injection:
    if ctx.rng.random() < 0.5:

        async def restart(_: MigrationProgress) -> str:
            await ctx.cluster.stack.restart_bus(kill=True)
            return "drain, nats-server SIGKILLed and restarted in phase 1"

        return await _drain_then(ctx, "nats_restart", ("phase1",), restart)
    await ctx.cluster.stack.restart_bus(kill=True)
    return Injection("nats_restart", None, "nats-server SIGKILLed and restarted while training")


async def _bus_node(ctx: FaultContext) -> tuple[int, str]:
    """A server to kill: half the time a leader (EVENTS stream or meta), else any."""
    servers = ctx.cluster.stack.bus_cluster()
    choice = ctx.rng.choice(["events leader", "meta leader", "any", "any"])
    name: str | None = None
    if choice == "events leader":
        stream = JobSubjects(ctx.cluster.job).stream("EVENTS")
        info = await ctx.cluster.nc.jetstream().stream_info(stream)
        name = info.cluster.leader if info.cluster else None
    elif choice == "meta leader":
        name = await asyncio.to_thread(servers.meta_leader)
    if name is None:
        return ctx.rng.randrange(len(servers.nodes)), "a server"
    return servers.index(name), f"the {choice}"


async def nats_node_kill(ctx: FaultContext) -> Injection:
    servers = ctx.cluster.stack.bus_cluster()
    killed: set[int] = set()

    async def kill(when: str) -> str:
        index, what = await _bus_node(ctx)
        await asyncio.to_thread(servers.stop_node, index, True)
        killed.add(index)
        return f"{what} ({servers.name(index)}) SIGKILLed {when}"

    async def in_phase1(_: MigrationProgress) -> str:
        return "drain, " + await kill("in phase 1")

    if ctx.rng.random() < 0.5:
        injection = await _drain_then(ctx, "nats_node_kill", ("phase1",), in_phase1)
    else:
        injection = Injection("nats_node_kill", None, await kill("while training"))
    injection.bus_nodes = killed
    return injection


async def store_kill(ctx: FaultContext) -> Injection:
    async def kill(when: str) -> str:
        name, _ = await asyncio.to_thread(ctx.cluster.stack.serving_replica)
        await ctx.cluster.stack.restart_service(name)
        return f"the serving store replica ({name}) SIGKILLed {when}"

    async def in_phase1(_: MigrationProgress) -> str:
        return "drain, " + await kill("in phase 1")

    if ctx.rng.random() < 0.5:
        injection = await _drain_then(ctx, "store_kill", ("phase1",), in_phase1)
        # A drain whose groups were being built fails (the machine trains on where it
        # was): recovered once it has ended either way.
        injection.left = set()
        return injection
    return Injection("store_kill", None, await kill("while training"))


INJECTORS: dict[str, Inject] = {
    "worker_kill": worker_kill,
    "machine_kill": machine_kill,
    "planner_kill": planner_kill,
    "executor_kill": executor_kill,
    "drain": drain,
    "straggler": straggler,
    "standby_dies": standby_dies,
    "leaver_dies": leaver_dies,
    "nats_restart": nats_restart,
    "nats_node_kill": nats_node_kill,
    "store_kill": store_kill,
}
