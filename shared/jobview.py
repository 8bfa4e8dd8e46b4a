"""A job's live picture, followed on the bus: for the demo's display and the status page.

`JobView` keeps, as the system publishes them: the planner's cluster state (machines,
roles, standbys and what they have warmed), the training step and its rate (from the
machines' step statistics), and every migration with the phases it went through, how
long each took and its downtime. `snapshot()` is all of it as one JSON document.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError

from trainmover import bus
from trainmover.bus.clusterstate import follow_states
from trainmover.client import TrainMoverClient, UnknownJob
from trainmover.logs import get_logger
from trainmover.messages import (
    TERMINAL_STATES,
    ClusterState,
    MigrationProgress,
    StepStats,
    decode,
)
from trainmover.subjects import JobSubjects
from trainmover.tasks import cancel_and_wait

RATE_WINDOW_S = 15.0
"""The step rate is measured over this many seconds of step statistics."""
RETRY_S = 0.5

log = get_logger("jobview")


@dataclass
class MigrationView:
    """One migration: what caused it, who moves, and each state it entered (and when)."""

    event_id: str
    kind: str = "migration"
    machine: str | None = None
    leaver: str | None = None
    joiner: str | None = None
    states: list[tuple[str, float]] = field(default_factory=list)
    downtime_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    detail: str = ""

    @property
    def state(self) -> str:
        return self.states[-1][0] if self.states else "planned"

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL_STATES

    def timeline(self, now: float | None = None) -> list[tuple[str, float]]:
        """(state, seconds spent in it) in order; the current one counts up to `now`."""
        out = []
        for (state, ts), nxt in zip(self.states, [*self.states[1:], None], strict=True):
            end = nxt[1] if nxt else (ts if self.ended else (now or time.time()))
            out.append((state, max(0.0, end - ts)))
        return out


class JobView:
    """Follows one job on the bus; an async context manager."""

    def __init__(self, nc: NatsClient, job: str, total_steps: int | None = None) -> None:
        self.nc = nc
        self.job = job
        self.total_steps = total_steps
        self.state: ClusterState | None = None
        self.steps: dict[str, int] = {}
        self._samples: deque[tuple[float, int]] = deque()
        self.migrations: dict[str, MigrationView] = {}
        self.listeners: list[Callable[[MigrationView], None]] = []
        """Called with a migration each time it enters a state."""
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Any = None
        self.started = time.time()

    async def __aenter__(self) -> JobView:
        self._sub = await self.nc.subscribe(JobSubjects(self.job).all_stats, cb=self._on_stats)
        self._tasks = [
            asyncio.create_task(self._retrying(self._follow_state), name="jobview-state"),
            asyncio.create_task(self._retrying(self._follow_items), name="jobview-items"),
        ]
        return self

    async def _retrying(self, follow: Callable[[], Awaitable[None]]) -> None:
        """Runs `follow` again whenever it stops: the job may not be registered yet (the
        view can start with the stack), and a bus outage ends a watch."""
        while True:
            try:
                await follow()
            except (BucketNotFoundError, UnknownJob):
                pass  # not registered yet
            except Exception as err:
                log.warning("jobview_follow_failed", job=self.job, error=str(err))
            await asyncio.sleep(RETRY_S)

    async def __aexit__(self, *_exc: object) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await cancel_and_wait(self._tasks, owner="jobview")

    # --- inputs ----------------------------------------------------------------------

    async def _on_stats(self, msg: Msg) -> None:
        stats = decode(StepStats, msg.data)
        self.steps[stats.machine] = max(self.steps.get(stats.machine, -1), stats.step)
        now = time.monotonic()
        self._samples.append((now, self.step))
        while self._samples and self._samples[0][0] < now - RATE_WINDOW_S:
            self._samples.popleft()

    async def _follow_state(self) -> None:
        kv = await bus.job_bucket(self.nc.jetstream(), self.job)
        async for state in follow_states(kv):
            self.state = state

    async def _follow_items(self) -> None:
        async with TrainMoverClient(self.nc).watch(self.job, from_start=True) as items:
            async for item in items:
                if isinstance(item, MigrationProgress):
                    self._on_progress(item)
                else:
                    view = self.migrations.setdefault(item.event_id, MigrationView(item.event_id))
                    view.kind, view.machine = item.kind, item.machine

    def _on_progress(self, p: MigrationProgress) -> None:
        view = self.migrations.setdefault(p.event_id, MigrationView(p.event_id))
        view.leaver = p.leaver or view.leaver
        view.joiner = p.joiner or view.joiner
        view.detail = p.detail or view.detail
        if p.phases:
            view.phases = dict(p.phases)
        if p.downtime_s is not None:
            view.downtime_s = p.downtime_s
        if not view.states or view.states[-1][0] != p.state:
            view.states.append((p.state, p.ts))
            for listener in self.listeners:
                listener(view)

    # --- what it shows -----------------------------------------------------------------

    @property
    def step(self) -> int:
        """The training step: the furthest any machine reported."""
        return max(self.steps.values(), default=0)

    def step_rate(self) -> float:
        """Steps per second over the last RATE_WINDOW_S seconds."""
        if len(self._samples) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def machines(self) -> list[dict[str, Any]]:
        """Every machine with its status, role (dp, pp) and the role types it has warmed."""
        if self.state is None:
            return []
        out = []
        for name, m in sorted(self.state.machines.items()):
            out.append(
                {
                    "machine": name,
                    "status": m.status,
                    "role": f"dp{m.cell.dp} pp{m.cell.pp}" if m.cell else None,
                    "standby": m.cell is None and m.status in ("standby", "joining", "maintenance"),
                    "warm": list(m.warm_role_types),
                }
            )
        return out

    def snapshot(self) -> dict[str, Any]:
        """The whole picture as JSON (the status page's /api/status)."""
        now = time.time()
        migrations = []
        for view in self.migrations.values():
            if not view.states:
                continue  # an event not (yet) planned
            doc = asdict(view)
            doc["state"] = view.state
            doc["ended"] = view.ended
            doc["timeline"] = [{"state": s, "seconds": d} for s, d in view.timeline(now)]
            del doc["states"]
            migrations.append(doc)
        layout = self.state.layout if self.state else None
        return {
            "job": self.job,
            "layout": (
                f"TP{layout.tp} x PP{layout.pp} x DP{layout.dp}" if layout is not None else None
            ),
            "revision": self.state.revision if self.state else None,
            "step": self.step,
            "total_steps": self.total_steps,
            "step_rate": round(self.step_rate(), 3),
            "machines": self.machines(),
            "in_flight": [m for m in migrations if not m["ended"]],
            "recent": [m for m in migrations if m["ended"]][-20:],
            "ts": now,
        }
