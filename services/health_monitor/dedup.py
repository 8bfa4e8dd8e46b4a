"""Dedup and rate limiting, pure: one incident per (job, machine, kind) per window.

An *incident* is the health-monitor's record that it emitted an event for a machine and
kind. While an incident is open, every further signal for the same key (a repeated
alert, the next missed heartbeat, a second worker exit) is a duplicate and emits
nothing; this is what turns an alert storm into one event. Windows are measured in wall
seconds so that incidents restored after a restart keep their age.

`TokenBucket` limits the rate of low-value output (dead letters) during a flood, and
`SeenWindow` remembers recently seen keys in bounded memory. Both take the time as an
argument, so they are tested without clocks or processes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")

IncidentKey = tuple[str, str, str]
"""(job, machine, kind)."""


@dataclass(frozen=True)
class Incident:
    """An emitted event, remembered so that its repeats are recognised."""

    job: str
    machine: str
    kind: str
    event_id: str
    source: str
    opened_ts: float

    @property
    def key(self) -> IncidentKey:
        return (self.job, self.machine, self.kind)


class IncidentTable:
    """Open incidents, at most one per key, each open for `window_s` seconds.

    Bounded by `max_entries` (the oldest incident is dropped first); keys only ever come
    from machines the cluster state knows, so the bound is a safety net, not a policy.
    """

    def __init__(self, window_s: float, max_entries: int = 100_000) -> None:
        if window_s <= 0:
            raise ValueError("dedup window must be positive")
        self.window_s = window_s
        self.max_entries = max_entries
        self._open: OrderedDict[IncidentKey, Incident] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def active(self, key: IncidentKey, now: float) -> Incident | None:
        """The open incident for `key`, or None when there is none or it aged out."""
        incident = self._open.get(key)
        if incident is None:
            return None
        if now - incident.opened_ts >= self.window_s:
            del self._open[key]
            return None
        return incident

    def open(self, incident: Incident) -> list[Incident]:
        """Records `incident`; returns the incidents evicted to stay within the bound."""
        self._open.pop(incident.key, None)
        self._open[incident.key] = incident
        evicted = []
        while len(self._open) > self.max_entries:
            evicted.append(self._open.popitem(last=False)[1])
        return evicted

    def close(self, key: IncidentKey) -> Incident | None:
        return self._open.pop(key, None)

    def close_machine(self, job: str, machine: str) -> list[Incident]:
        """Closes every incident of one machine (the planner acted on it)."""
        keys = [k for k in self._open if k[0] == job and k[1] == machine]
        return [self._open.pop(k) for k in keys]

    def expire(self, now: float) -> list[Incident]:
        """Drops the incidents older than the window; returns them."""
        old = [i for i in self._open.values() if now - i.opened_ts >= self.window_s]
        for incident in old:
            del self._open[incident.key]
        return old

    def all(self) -> list[Incident]:
        return list(self._open.values())


class SeenWindow(Generic[K]):
    """Remembers keys for `window_s` seconds in at most `max_entries` slots.

    `first(key, now)` is True when `key` was not seen within the window; used to report
    one dead letter per unknown machine instead of one per heartbeat or alert.
    """

    def __init__(self, window_s: float, max_entries: int = 10_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[K, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def first(self, key: K, now: float) -> bool:
        seen = self._seen.get(key)
        if seen is not None and now - seen < self.window_s:
            return False
        self._seen.pop(key, None)
        self._seen[key] = now
        # Oldest first: evicting from the front forgets the least recent key, which at
        # worst lets one more duplicate through; memory stays bounded either way.
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return True


class TokenBucket:
    """Allows `rate` actions per second on average, with bursts of up to `burst`."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("token bucket needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = now

    def allow(self, now: float) -> bool:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = max(self._at, now)
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False
