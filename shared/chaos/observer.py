"""What the chaos soak sees of a running local cluster, from the bus alone.

The observer keeps the job's step timeline (from the step statistics, each at the time
its machine stamped it: a bus outage delays the statistics, not the steps), every machine's
last heartbeat, the migration progress and the events, all from plain subscriptions
(they resume by themselves after a nats-server restart). Every message wakes the waits,
so `until` re-evaluates its predicate on each heartbeat (0.2 s on a local cluster)
instead of sleeping.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from trainmover.client import TrainMoverError
from trainmover.localcluster import LocalCluster
from trainmover.messages import (
    ClusterState,
    Heartbeat,
    MessageError,
    MigrationProgress,
    StepStats,
    StragglerEvent,
    decode,
    decode_event,
)
from trainmover.subjects import JobSubjects

T = TypeVar("T")

#: Errors of a check that a later try may not have: the bus restarting, the planner not
#: having registered the job yet.
TRANSIENT = (TimeoutError, OSError, NatsError, TrainMoverError)


class Observer:
    """Follows one job's published signals; `start()` subscribes, `stop()` ends it."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.job = cluster.job
        #: (the machine's stamp, job step) each time the job's furthest step grew.
        self.timeline: list[tuple[float, int]] = []
        #: Per step, the longest a machine's training thread waited for a CPU outside
        #: its collectives (`StepStats.queued_s`): the slowest machine sets the pace.
        self.queued: dict[int, float] = {}
        self.steps: dict[str, int] = {}
        self.beats: dict[str, Heartbeat] = {}
        self.progress: list[MigrationProgress] = []
        self.stragglers: list[StragglerEvent] = []
        self._changed = asyncio.Condition()
        self._subs: list[object] = []

    async def start(self) -> Observer:
        subjects = JobSubjects(self.job)
        nc = self.cluster.nc
        for subject, handler in (
            (subjects.all_stats, self._on_stats),
            (subjects.heartbeats, self._on_beat),
            (subjects.progress, self._on_progress),
            (subjects.events, self._on_event),
        ):
            self._subs.append(await nc.subscribe(subject, cb=handler))
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()  # type: ignore[attr-defined]
            except Exception:  # noqa: S110 - the connection may be closing already
                pass

    # --- handlers ----------------------------------------------------------------------

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _on_stats(self, msg: Msg) -> None:
        try:
            stats = decode(StepStats, msg.data)
        except MessageError:
            return
        self.steps[stats.machine] = max(self.steps.get(stats.machine, -1), stats.step)
        self.queued[stats.step] = max(self.queued.get(stats.step, 0.0), stats.queued_s)
        if not self.timeline or stats.step > self.timeline[-1][1]:
            self.timeline.append((stats.ts, stats.step))
        await self._notify()

    async def _on_beat(self, msg: Msg) -> None:
        try:
            beat = decode(Heartbeat, msg.data)
        except MessageError:
            return
        self.beats[beat.machine] = beat
        await self._notify()

    async def _on_progress(self, msg: Msg) -> None:
        try:
            self.progress.append(decode(MigrationProgress, msg.data))
        except MessageError:
            return
        await self._notify()

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except MessageError:
            return
        if isinstance(event, StragglerEvent):
            self.stragglers.append(event)
        await self._notify()

    # --- queries -----------------------------------------------------------------------

    @property
    def job_step(self) -> int:
        return self.timeline[-1][1] if self.timeline else 0

    @property
    def last_step(self) -> tuple[float, int]:
        """(stamp, step) of the job's furthest step; (0.0, 0) before any."""
        return self.timeline[-1] if self.timeline else (0.0, 0)

    def step_time(self, window_s: float = 30.0) -> float:
        """The recent normal step time: stamped time over steps in the last `window_s`."""
        if len(self.timeline) < 2:
            return 0.0
        end_t, end_step = self.timeline[-1]
        start = next((p for p in self.timeline if p[0] >= end_t - window_s), self.timeline[0])
        if end_step <= start[1]:
            return 0.0
        return (end_t - start[0]) / (end_step - start[1])

    def queued_extra(self, first: int, last: int, window_s: float = 30.0) -> float | None:
        """Seconds the job's steps `first`..`last` waited for a CPU beyond the recent
        normal (the median per step in the `window_s` before `first`); None without
        statistics for both."""
        start_t = next((t for t, s in self.timeline if s >= first), None)
        if start_t is None:
            return None
        before = [
            self.queued[s] for t, s in self.timeline
            if start_t - window_s <= t < start_t and s in self.queued
        ]  # fmt: skip
        during = [self.queued[s] for s in range(first, last + 1) if s in self.queued]
        if not before or not during:
            return None
        normal = statistics.median(before)
        return round(sum(during) - normal * len(during), 3)

    def progress_of(self, event_id: str) -> list[MigrationProgress]:
        return [p for p in self.progress if p.event_id == event_id]

    async def state(self) -> ClusterState:
        return await self.cluster.client.status(self.job)

    async def until(
        self, check: Callable[[], Awaitable[T | None]], timeout_s: float, what: str
    ) -> T:
        """Re-evaluates `check` on every observed message until it returns a value other
        than None (or False); raises TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout_s
        last: BaseException | None = None
        while True:
            try:
                result = await check()
            except TRANSIENT as err:
                result, last = None, err  # the bus or the planner may be restarting
            else:
                last = None
            if result is not None and result is not False:
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = f" (last error: {last})" if last else ""
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}{detail}")
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
                except TimeoutError:
                    pass  # nothing observed (the bus is down): re-check anyway
