"""One simulated machine: the smallest stand-in for a sidecar that the real control plane
cannot tell from one, with no worker processes behind it.

It speaks the sidecar's protocol on the real bus with the real message classes: a
`Heartbeat` every interval (its workers as the sidecar reports them), the `StepStats` of
its local rank 0 at the end of every step while it trains, and the executor's commands
through the real `bus.CommandServer` (idempotent by command id). The workers' part of
each command is a delay (`SimTiming`, a few to tens of ms, jittered per command): phase 1
of a prepare, a commit, a recovery's abort and group builds, the switch itself; a
`transfer` waits for the boundary after the switch step, and `steps` for the step asked,
on the job's step clock (`JobClock`), which every simulated machine of the job shares.
Each answered command is recorded with the seconds the workers were busy in it, so the
benchmark can tell the control plane's time from theirs.

What a sidecar does that this does not: spawn and supervise processes, relay to local
ranks, sample their CPU, report collective errors and stalls (no collective ever runs).
The step clock never stalls at a switch (nothing here measures downtime).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NatsClient

from trainmover import bus
from trainmover.logs import get_logger
from trainmover.messages import Command, Heartbeat, Plan, StepStats, WorkerStatus, new_id
from trainmover.planwire import plan_of
from trainmover.runtime.config import JobConfig
from trainmover.services.executor.switch import TOO_LATE
from trainmover.subjects import JobSubjects
from trainmover.tasks import cancel_and_wait

log = get_logger("simmachine")


@dataclass(frozen=True)
class SimTiming:
    """The simulated workers' own times (seconds) and the job's step and heartbeat rate."""

    step_s: float = 1.0
    heartbeat_s: float = 0.5
    prepare_s: float = 0.020
    commit_s: float = 0.002
    recover_s: float = 0.030
    switch_s: float = 0.050
    release_s: float = 0.100
    warm_s: float = 0.200
    #: Each delay is drawn uniformly within +-jitter of its value, per command.
    jitter: float = 0.25


@dataclass(frozen=True)
class JobClock:
    """The job's steps: step n (n >= 1) ends at `start + n * step_s` on every machine."""

    start: float
    step_s: float

    def step(self, now: float | None = None) -> int:
        """The last step completed at `now` (wall clock)."""
        return max(0, math.floor(((now or time.time()) - self.start) / self.step_s))

    def end_of(self, step: int) -> float:
        return self.start + step * self.step_s


@dataclass(frozen=True)
class CommandRecord:
    """One command a simulated machine answered; `busy_s` is its workers' share."""

    machine: str
    op: str
    plan_id: str | None
    received: float
    replied: float
    busy_s: float
    ok: bool


@dataclass
class PlanView:
    """What a machine needs of a plan, computed once per plan for every machine of a
    host (a sidecar reads only its own ranks; scanning the plan per machine would make
    the host, not the control plane, the slow part)."""

    plan: Plan
    ranks: dict[str, set[int]] = field(default_factory=dict)
    groups: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan) -> PlanView:
        view = cls(plan)
        for spec in [*plan.groups, *plan.transfers]:
            for ref in spec.members:
                view.ranks.setdefault(ref.machine, set()).add(ref.local_rank)
                view.groups.setdefault(ref.machine, set()).add(spec.name)
        return view

    def part(self, machine: str) -> str:
        if machine in self.plan.joiners():
            return "joiner"
        if self.plan.migration == "planned" and machine in self.plan.leavers():
            return "leaver"
        return "source" if machine in self.plan.sources() else "stayer"


class PlanCache:
    """Decoded plans by plan id, shared by the machines of one host."""

    def __init__(self, keep: int = 64) -> None:
        self._views: dict[str, PlanView] = {}
        self._keep = keep

    def view(self, command: Command) -> PlanView:
        key = command.plan_id or ""
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = PlanView.of(plan_of(command))
            while len(self._views) > self._keep:
                self._views.pop(next(iter(self._views)))
        return found


class SimMachine:
    """One machine's sidecar, simulated; `start()` serves, `silence()` kills it."""

    def __init__(
        self,
        nc: NatsClient,
        config: JobConfig,
        name: str,
        clock: JobClock,
        timing: SimTiming,
        plans: PlanCache,
        record: Callable[[CommandRecord], None],
    ) -> None:
        self.nc, self.config, self.name = nc, config, name
        self.clock, self.timing, self._plans, self._record = clock, timing, plans, record
        self._subjects = JobSubjects(config.job)
        self._rng = random.Random(f"{config.job}/{name}")
        self.status = "active" if name in config.cluster.machines else "standby"
        self.instance = new_id()
        self.warm_types: list[str] = []
        self.switched = False  # a leaver's workers left at the switch (exit code 0)
        self._fenced = ""  # the instance fenced (once each)
        self._switch_done: dict[str, float] = {}
        self._seq = 0
        self._server: bus.CommandServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._beat_now = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        self._server = bus.CommandServer(self.nc, self.config.job, self.name, self._handle)
        await self._server.start()
        self._tasks += [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._stats())]
        if self.status == "standby":
            self._tasks.append(asyncio.create_task(self._warm_up()))

    async def silence(self) -> float:
        """The machine dies at once: no heartbeat, no statistics, no answer. Returns when."""
        at = time.time()
        if self._server is not None:
            await self._server.stop()
            self._server = None
        await cancel_and_wait(self._tasks, owner=f"sim-{self.name}")
        self._tasks = []
        return at

    async def revive(self) -> None:
        """The machine comes back repaired: a fresh standby (a new instance), warming."""
        await self.silence()
        self.status, self.instance, self.warm_types, self.switched = "standby", new_id(), [], False
        await self.start()

    # --- signals -----------------------------------------------------------------------

    def _workers(self) -> list[WorkerStatus]:
        if self.status == "maintenance":
            return []
        step = self.clock.step() if self.status in ("active", "leaving") else None
        state = "standby" if self.status == "standby" else "running"
        if self.switched:
            state = "exited"
        return [
            WorkerStatus(
                local_rank=r,
                pid=os.getpid(),
                state=state,  # type: ignore[arg-type]
                exit_code=0 if self.switched else None,
                step=step,
            )
            for r in range(self.config.layout.ranks_per_machine)
        ]

    async def _heartbeats(self) -> None:
        # Sidecars start at different times: their beats are spread over the interval.
        await asyncio.sleep(self._rng.uniform(0, self.timing.heartbeat_s))
        while True:
            beat = Heartbeat(
                job=self.config.job,
                machine=self.name,
                seq=self._seq,
                status=self.status,  # type: ignore[arg-type]
                workers=self._workers(),
                warm_role_types=self.warm_types if self.status == "standby" else [],
                instance=self.instance,
            )
            self._seq += 1
            with contextlib.suppress(Exception):  # a beat lost with the connection: the next
                await self.nc.publish(self._subjects.heartbeat(self.name), beat.to_json())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.timing.heartbeat_s)
            self._beat_now.clear()

    async def _stats(self) -> None:
        while True:
            step = self.clock.step() + 1
            # Steps end together on every machine of a job, a few ms apart.
            end = self.clock.end_of(step)
            await asyncio.sleep(max(0.0, end - time.time()) + self._rng.uniform(0, 0.005))
            if self.status not in ("active", "leaving") or self.switched:
                continue
            stats = StepStats(
                job=self.config.job,
                machine=self.name,
                step=step,
                compute_s=self.timing.step_s * self._rng.uniform(0.68, 0.72),
                ts=end,
            )
            with contextlib.suppress(Exception):
                await self.nc.publish(self._subjects.stats(self.name), stats.to_json())

    async def _warm_up(self) -> None:
        """Shadow iterations after a launch; the heartbeat then offers the machine as warm."""
        await asyncio.sleep(self._delay(self.timing.warm_s))
        self.warm_types = list(self.config.layout.role_types())
        self._beat_now.set()

    # --- commands ----------------------------------------------------------------------

    def _delay(self, seconds: float) -> float:
        return seconds * self._rng.uniform(1 - self.timing.jitter, 1 + self.timing.jitter)

    async def _busy(self, until: float) -> float:
        """Waits until wall time `until`; returns the seconds waited."""
        wait = max(0.0, until - time.time())
        await asyncio.sleep(wait)
        return wait

    async def _handle(self, command: Command) -> dict[str, Any]:
        received = time.time()
        busy = [0.0]
        ok = False
        try:
            result = await self._dispatch(command, busy)
            ok = True
            return result
        finally:
            self._record(
                CommandRecord(
                    self.name, command.op, command.plan_id, received, time.time(), busy[0], ok
                )
            )

    async def _dispatch(self, command: Command, busy: list[float]) -> dict[str, Any]:
        """The sidecar's answer to each op (services/sidecar/service.py), the workers'
        time spent in `busy[0]`."""
        op, now = command.op, time.time()
        if op == "status":
            return {"step": self.clock.step(), "status": self.status, "instance": self.instance,
                    "workers": [w.model_dump() for w in self._workers()]}  # fmt: skip
        if op == "fence":
            return await self._fence(str(command.args.get("instance") or ""))
        if op == "warm":
            return {"role_types": list(self.config.layout.role_types()), "errors": []}
        if op == "steps":
            step = int(command.args["step"])
            busy[0] = await self._busy(self.clock.end_of(step))
            return {"t_end": self.clock.end_of(step), "median_step_s": self.timing.step_s}
        if op not in ("prepare", "commit", "recover", "transfer", "release", "abort"):
            raise ValueError(f"unsupported op {op!r} (a simulated machine)")
        view = self._plans.view(command)
        plan, ranks = view.plan, len(view.ranks.get(self.name, ()))
        if op in ("prepare", "recover") and self.status == "standby" and not self.warm_types:
            raise ValueError(f"{self.name} is a standby not warm (yet)")
        if op == "prepare":
            if self.name in plan.leavers():
                self.status = "leaving"
            busy[0] = await self._busy(now + self._delay(self.timing.prepare_s))
            return {"ranks": ranks, "build_s": busy[0], "steps_during_build": 0,
                    "step": self.clock.step()}  # fmt: skip
        if op == "commit":
            return await self._commit(view, int(command.args["step"]), busy)
        if op == "recover":
            busy[0] = await self._busy(now + self._delay(self.timing.recover_s))
            # The workers switch on their own once recovered; `transfer` waits for it.
            self._switch_done[plan.plan_id] = time.time() + self._delay(self.timing.switch_s)
            return {"ranks": self.config.layout.ranks_per_machine, "committed": self.clock.step()}
        if op == "transfer":
            return await self._transfer(view, busy)
        if op == "release":
            if self.name not in plan.leavers():
                return {"released": False}
            busy[0] = await self._busy(now + self._delay(self.timing.release_s))
            self.status = "maintenance"
            self._beat_now.set()
            self._tasks.append(asyncio.create_task(self._return_after_maintenance()))
            return {"released": True, "maintenance_s": self.config.cluster.maintenance_s}
        return self._abort(plan)

    async def _commit(self, view: PlanView, k: int, busy: list[float]) -> dict[str, Any]:
        step = self.clock.step()
        busy[0] = await self._busy(time.time() + self._delay(self.timing.commit_s))
        mine = sorted(view.ranks.get(self.name, ()))
        joiner = self.name in view.plan.joiners()
        if joiner or step < k:
            # The workers switch at the boundary after k (a joiner waits there for state).
            self._switch_done[view.plan.plan_id] = self.clock.end_of(k) + self._delay(
                self.timing.switch_s
            )
            return {"accepted": len(mine), "refused": {}, "passed": 0 if joiner else step}
        return {"accepted": 0, "refused": {f"{self.name}/{r}": TOO_LATE for r in mine},
                "passed": step}  # fmt: skip

    async def _transfer(self, view: PlanView, busy: list[float]) -> dict[str, Any]:
        plan = view.plan
        done = self._switch_done.get(plan.plan_id)
        if done is None:
            raise RuntimeError(f"plan {plan.plan_id}: no commit or recover reached {self.name}")
        busy[0] = await self._busy(done)
        part = view.part(self.name)
        if part == "joiner":
            self.status = "active"
        elif part == "leaver":
            self.switched = True
        step = self.clock.step(done - self.timing.switch_s)
        return {
            "parts": [part],
            "rebuilt": sorted(view.groups.get(self.name, ())),
            "repaired": [],
            "step": step,
            "t_start": done - busy[0],
            "t_end": done,
            "transfer_bytes": 0,
            "transfer_s": self.timing.switch_s if part in ("leaver", "source") else 0.0,
            "source": ["leaver" if plan.migration == "planned" else "replica"],
        }

    def _abort(self, plan: Plan) -> dict[str, Any]:
        if self.name in plan.joiners() and self.status != "active":
            self._tasks.append(asyncio.create_task(self._relaunch_as_standby()))
            return {"relaunched": True}
        if self.name in plan.leavers() and self.status == "leaving":
            self.status = "active"
            self._beat_now.set()
        return {"relaunched": False, "status": self.status}

    async def _fence(self, instance: str) -> dict[str, Any]:
        if instance and instance != self.instance:
            return {"fenced": False, "instance": self.instance, "reason": "a newer instance"}
        fenced = self.instance
        self.fenced(fenced)
        return {"fenced": True, "instance": fenced}

    def fenced(self, instance: str) -> None:
        """The planner declared this instance failed (a fence command, or the cluster
        state, `fencing.fenced_in`): its workers go, the machine returns as a standby."""
        if instance == self.instance and self._fenced != instance:
            self._fenced = instance
            self._tasks.append(asyncio.create_task(self._relaunch_as_standby()))

    async def _return_after_maintenance(self) -> None:
        await asyncio.sleep(self.config.cluster.maintenance_s)
        await self._relaunch_as_standby()

    async def _relaunch_as_standby(self) -> None:
        self.status, self.warm_types = "maintenance", []
        self._beat_now.set()
        await asyncio.sleep(self._delay(self.timing.warm_s))  # the workers' launch
        self.instance, self.switched, self.status = new_id(), False, "standby"
        self._beat_now.set()
        await self._warm_up()
