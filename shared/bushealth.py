"""Whether a service's bus can decide: a periodic JetStream probe, logged and exported.

Core NATS (heartbeats, step statistics, commands) flows while any server is up; what
needs a quorum is JetStream: every event, plan, progress and state write. So the probe
asks for the info of the job's cluster-state stream (`KV_TM_<job>`) and judges its
quorum from it (`has_quorum`): the probe fails while the service's own connection is
down, the stream has no leader (an election, seconds), or too few of its replicas were
heard from lately. (A leader cut off from its followers keeps answering the info for a
while, so an answer alone proves nothing.) A service
reports the bus *degraded* from the first failed probe (log line `bus_degraded` with the
cause, gauge `trainmover_bus_degraded` = 1) until one succeeds again (`bus_recovered`
with how long it lasted, gauge 0). Nothing else is decided from it: the services wait on
the bus and carry on from their durable state when it is back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.js.api import ClusterInfo
from prometheus_client import Gauge

from trainmover.logs import get_logger
from trainmover.metric_names import BUS_DEGRADED
from trainmover.metrics import Registry
from trainmover.subjects import JobSubjects, kv_stream

log = get_logger("bus")

PROBE_EVERY_S = 1.0
"""How often the probe runs; also how long one probe waits for its answer."""


REPLICA_SILENT_S = 3.0
"""A replica its leader has not heard from for this long is counted as gone (raft
peers hear from each other about every second when idle)."""


def has_quorum(cluster: ClusterInfo | None) -> bool:
    """Whether a stream, as its `stream_info` reports its cluster, can take a write: a
    leader and enough replicas heard from lately for a majority. A stream of one replica
    (a standalone server) has it whenever it answers."""
    if cluster is None:
        return True
    if not cluster.leader:
        return False
    replicas = cluster.replicas or []
    heard = [
        p
        for p in replicas
        if p.current and not p.offline and (p.active or 0) / 1e9 < REPLICA_SILENT_S
    ]
    return 1 + len(heard) > (1 + len(replicas)) // 2


@dataclass
class BusState:
    """The degraded/healthy state from probe outcomes (pure: no clock, no bus)."""

    degraded_since: float | None = None

    def observe(self, ok: bool, now: float) -> str | None:
        """'degraded' or 'recovered' when this outcome changes the state, else None."""
        if not ok and self.degraded_since is None:
            self.degraded_since = now
            return "degraded"
        if ok and self.degraded_since is not None:
            self.degraded_since = None
            return "recovered"
        return None


def degraded_gauge(registry: Registry) -> Gauge:
    """The service's `trainmover_bus_degraded` gauge, declared in its registry."""
    return registry.gauge(BUS_DEGRADED, "1 while this service's bus cannot take durable writes")


class BusHealth:
    """Probes the cluster-state streams of `jobs` for the service `service`, setting
    `gauge` (see `degraded_gauge`)."""

    def __init__(
        self, service: str, gauge: Gauge, jobs: Iterable[str], every_s: float = PROBE_EVERY_S
    ) -> None:
        self.service = service
        self.jobs = ",".join(jobs := list(jobs))
        self.streams = [kv_stream(JobSubjects(job).bucket) for job in jobs]
        self.every_s = every_s
        self.state = BusState()
        #: Called with "degraded" or "recovered" on each change.
        self.listeners: list[Callable[[str], None]] = []
        self._gauge = gauge
        self._gauge.set(0)

    @property
    def degraded(self) -> bool:
        return self.state.degraded_since is not None

    async def watch(self, nc: NatsClient) -> None:
        """Probes until cancelled."""
        js = nc.jetstream(timeout=self.every_s)
        while True:
            started = time.monotonic()
            cause = ""
            try:
                if not nc.is_connected:
                    raise ConnectionError("not connected to any server")
                for stream in self.streams:
                    if not has_quorum((await js.stream_info(stream)).cluster):
                        raise ConnectionError(f"{stream} has no leader or no quorum")
            except asyncio.CancelledError:
                raise
            except Exception as err:
                cause = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            self._report(self.state.degraded_since, self.state.observe(not cause, started), cause)
            await asyncio.sleep(max(0.0, self.every_s - (time.monotonic() - started)))

    def _report(self, since: float | None, change: str | None, cause: str) -> None:
        if change == "degraded":
            self._gauge.set(1)
            log.warning("bus_degraded", service=self.service, job=self.jobs, cause=cause)
        elif change == "recovered":
            self._gauge.set(0)
            lasted = time.monotonic() - since if since is not None else 0.0
            log.info(
                "bus_recovered", service=self.service, job=self.jobs, degraded_s=round(lasted, 2)
            )
        if change is not None:
            for listener in self.listeners:
                listener(change)
