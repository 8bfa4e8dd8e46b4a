"""What `trainmover bench control-plane` reads from outside the services it measures: when
events, plans and progress reach the bus, the processes' CPU and memory, the bus's
message counts, the cluster state's size and write time, and how long `trainmover
status` and the status page take to answer.

Nothing here changes what the services do: the bus is read through subscriptions of
its own, processes through /proc, the servers through their monitoring port.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from trainmover import bus, statepieces
from trainmover.bench import cpu
from trainmover.bench.simmachine import CommandRecord
from trainmover.bus.clusterstate import StateStore
from trainmover.logs import get_logger
from trainmover.messages import (
    MAX_MESSAGE_BYTES,
    TERMINAL_STATES,
    ClusterState,
    MessageError,
    MigrationProgress,
    Plan,
    decode,
    decode_event,
)
from trainmover.subjects import STATE_KEY, JobSubjects

log = get_logger("bench.control-plane")
T = TypeVar("T")


@dataclass(frozen=True)
class Seen:
    """One message of the job as it reached the bus's observer (wall clock)."""

    at: float
    message: Any


class Observer:
    """Events, plans and progress of a job as they reach the bus: core subscriptions on
    the streams' subjects (a copy of each message, whoever consumes the streams)."""

    def __init__(self, nc: NatsClient, job: str) -> None:
        self.nc, self.job = nc, job
        self.events: list[Seen] = []
        self.plans: list[Seen] = []
        self.progress: list[Seen] = []
        self._changed = asyncio.Condition()
        self._subs: list[Any] = []

    async def start(self) -> None:
        s = JobSubjects(self.job)
        for subject, into, parse in (
            (s.events, self.events, decode_event),
            (s.plans, self.plans, lambda raw: decode(Plan, raw)),
            (s.progress, self.progress, lambda raw: decode(MigrationProgress, raw)),
        ):
            self._subs.append(await self.nc.subscribe(subject, cb=self._keep(into, parse)))
        await self.nc.flush()

    def _keep(self, into: list[Seen], parse: Callable[[bytes], Any]) -> Callable[[Msg], Any]:
        async def on(msg: Msg) -> None:
            at = time.time()
            try:
                into.append(Seen(at, parse(msg.data)))
            except MessageError as err:
                log.warning("unreadable_message", subject=msg.subject, error=str(err))
                return
            async with self._changed:
                self._changed.notify_all()

        return on

    async def wait(self, find: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """The first non-None `find()`, re-evaluated as each message arrives."""
        found: list[T] = []

        def done() -> bool:
            value = find()
            if value is not None:
                found.append(value)
            return value is not None

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(done), timeout_s)
            except TimeoutError:
                raise TimeoutError(f"no {what} within {timeout_s:.0f} s") from None
        return found[0]

    def event_for(self, machine: str, kind: str, after: float) -> Seen | None:
        return next(
            (
                e
                for e in self.events
                if e.at >= after and e.message.machine == machine and e.message.kind == kind
            ),
            None,
        )

    def plan_for(self, event_id: str) -> Seen | None:
        return next((p for p in self.plans if p.message.event_id == event_id), None)

    def end_of(self, event_id: str) -> Seen | None:
        """The terminal progress of `event_id`'s migration (done, failed, rejected...)."""
        return next(
            (
                p
                for p in self.progress
                if p.message.event_id == event_id and p.message.state in TERMINAL_STATES
            ),
            None,
        )

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()


def workers_busy_s(records: Iterable[CommandRecord], start: float, end: float) -> float:
    """Seconds of [start, end] in which some simulated machine's workers were busy with a
    command (the union of their busy spans): the workers' time, not the control plane's."""
    spans = sorted(
        (max(start, r.replied - r.busy_s), min(end, r.replied)) for r in records if r.busy_s > 0
    )
    covered, reach = 0.0, start
    for a, b in spans:
        a = max(a, reach)
        if b > a:
            covered += b - a
            reach = b
    return covered


async def newest_states(nc: NatsClient, job: str) -> AsyncIterator[ClusterState]:
    """The job's cluster state each time its watch has caught up with the writes: the
    watch carries no values (`meta_only`) and the newest is read once per burst, so a
    follower of thousands of revisions a second (a large job starting) reads a few of
    them, not each (the services' own followers read each; this one must not compete
    with them for the CPU)."""
    kv = await bus.job_bucket(nc.jetstream(), job)
    store = StateStore(kv)
    watcher = await kv.watch(STATE_KEY, meta_only=True)
    try:
        async for entry in watcher:
            if entry is None or entry.delta:
                continue  # the initial marker, or not the newest yet
            latest = await store.read()
            if latest is not None:
                yield latest.state
    finally:
        await watcher.stop()


# --- processes ---------------------------------------------------------------------------


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each named process."""
    return {name: cpu.cpu_s([pid]) for name, pid in pids.items()}


def cpu_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after if name in before}


def varz(monitor_urls: list[str]) -> dict[str, int]:
    """in_msgs, out_msgs, in_bytes, out_bytes summed over the servers (`/varz`); each
    server counts what it got from clients and from its routes."""
    total = {"in_msgs": 0, "out_msgs": 0, "in_bytes": 0, "out_bytes": 0}
    for url in monitor_urls:
        with urllib.request.urlopen(f"{url.rstrip('/')}/varz", timeout=5) as reply:  # noqa: S310
            doc = json.load(reply)
        for key in total:
            total[key] += int(doc.get(key, 0))
    return total


# --- the cluster state --------------------------------------------------------------------


def _median_time(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def state_costs(nc: NatsClient, job: str, n: int = 5) -> dict[str, Any]:
    """The cluster state's size as stored (its pieces and head) and as one JSON value,
    its largest stored value, and what one update of it costs: the planner's encode of
    what a machine's change rewrites (the rest, the machine's shard, the head), those
    values' writes to the job's bucket (to keys of their own beside the state's, so
    nobody following the state sees them, as the planner writes them: together), and a
    reader's decode of them. Medians of `n`."""
    kv = await bus.job_bucket(nc.jetstream(), job)
    stored = await StateStore(kv).read()
    assert stored is not None, "no cluster state stored"
    state = stored.state
    head = (await kv.get(STATE_KEY)).value or b""
    shards = statepieces.shard_count(len(state.machines))
    some = next(iter(state.machines), "")
    machines = statepieces.shards_of(state.machines, shards)[statepieces.shard_of(some, shards)]

    def encode() -> list[bytes]:
        nxt = state.model_copy(update={"revision": state.revision + 1})
        pieces = [statepieces.rest_piece(nxt), statepieces.machine_piece(nxt, machines)]
        return [p.to_json() for p in pieces]

    update = [*encode(), head]
    puts = []
    for _ in range(n):
        t0 = time.perf_counter()
        await asyncio.gather(*(kv.put(f"bench-probe.{i}", raw) for i, raw in enumerate(update)))
        puts.append(time.perf_counter() - t0)
    for i in range(len(update)):
        await kv.purge(f"bench-probe.{i}")
    whole = state.to_json()
    largest = max(
        [len(head)]
        + [
            len(c)
            for p in statepieces.split(state)[1].values()
            for c in statepieces.chunks(p.to_json())
        ]
    )
    return {
        "bytes": stored.bytes,
        "whole_bytes": len(whole),
        "largest_value_bytes": largest,
        "update_bytes": sum(len(raw) for raw in update),
        "shards": shards,
        "revision": stored.revision,
        "machines": len(state.machines),
        "generations": len(state.generations),
        "handled": len(state.handled),
        "encode_s": _median_time(encode, n),
        "decode_s": _median_time(lambda: [statepieces.decode_piece(r) for r in update[:2]], n),
        "whole_decode_s": _median_time(lambda: decode(ClusterState, whole), n)
        if len(whole) <= MAX_MESSAGE_BYTES
        else None,
        "put_s": statistics.median(puts),
    }


# --- what an operator waits for -------------------------------------------------------------


async def status_cli_s(url: str, job: str) -> float:
    """`trainmover status JOB` (its table) as a subprocess, start to exit; RuntimeError
    when it fails."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainmover.cli", "--nats-url", url, "status", job,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"trainmover status exited {proc.returncode}: {err.decode()[-300:]}")
    return time.perf_counter() - t0


class PageHost:
    """The status page's own process (`trainmover.bench.pagehost`)."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port

    @classmethod
    async def start(cls, url: str, job: str, log_file: Path, timeout_s: float) -> PageHost:
        with open(log_file, "ab") as err:  # noqa: ASYNC230 - a local file, opened once
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trainmover.bench.pagehost", "--nats-url", url, "--job", job,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
            )  # fmt: skip
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError(f"the status page's process exited ({await proc.wait()})")
        return cls(proc, int(json.loads(line)["port"]))

    async def answer_s(self) -> float:
        """One GET of the page's /api/status (what the page polls every second)."""

        def get() -> float:
            t0 = time.perf_counter()
            url = f"http://127.0.0.1:{self.port}/api/status"
            with urllib.request.urlopen(url, timeout=60) as reply:  # noqa: S310 - loopback
                reply.read()
            return time.perf_counter() - t0

        return await asyncio.to_thread(get)

    async def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
