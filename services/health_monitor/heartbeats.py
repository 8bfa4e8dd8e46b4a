"""Heartbeat tracking, pure: which watched machines went silent, and which came back.

A machine is *watched* while the cluster state gives it a watched status (active,
standby, leaving by default). Each heartbeat pushes its deadline to `now + timeout`; a
machine whose deadline passes is *lapsed* and reported once, until a heartbeat brings it
back. A machine that starts being watched (at service start, or when it appears in the
cluster state) gets `grace` seconds for its first heartbeat, so a restarted monitor
does not declare every machine dead before it could hear from them; likewise, after the
monitor itself was cut off from the bus, `rebase` restarts every deadline. Heartbeats of
machines not watched (yet) are remembered: one heard within the timeout before its watch
began is judged by the timeout from that heartbeat, not given the grace (a standby
admitted to the pool and picked as a joiner at once, then killed, is found dead in one
timeout, not one grace period).

Time is an argument (monotonic seconds), so this is tested without clocks or processes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from trainmover.messages import Heartbeat, WorkerStatus

MachineKey = tuple[str, str]
"""(job, machine)."""

HEARD_MAX = 4096
"""How many machines not watched the tracker remembers the last heartbeat of (bounded:
a machine unknown to the cluster state is remembered too, and names are the sender's)."""


@dataclass(frozen=True)
class Lapse:
    """A watched machine missed its heartbeats."""

    job: str
    machine: str
    last_seen: float | None
    """Monotonic time of its last heartbeat; None when none was heard since watching."""
    last_seq: int | None
    last_sent_ts: float | None
    """The sender's timestamp of its last heartbeat (names the incident)."""
    silent_s: float
    """Seconds since its last heartbeat (or since watching began)."""


@dataclass(frozen=True)
class _Heard:
    at: float
    seq: int
    sent_ts: float | None


@dataclass
class _Watch:
    since: float
    deadline: float
    last_seen: float | None = None
    last_seq: int | None = None
    last_sent_ts: float | None = None
    down: bool = False
    version: int = 0


class HeartbeatTracker:
    """Deadlines of every watched machine; `lapsed(now)` reports each silence once."""

    def __init__(self, timeout_s: float, grace_s: float) -> None:
        if timeout_s <= 0 or grace_s < 0:
            raise ValueError("heartbeat timeout must be positive and grace non-negative")
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._watches: dict[MachineKey, _Watch] = {}
        self._heard: OrderedDict[MachineKey, _Heard] = OrderedDict()
        # (deadline, version, key): a heap with lazy deletion, so a heartbeat is O(log n)
        # and a check is O(lapsed); stale entries are skipped by their version.
        self._heap: list[tuple[float, int, MachineKey]] = []
        # Per job, machines watched and of them down: counted as they change, because
        # every heartbeat updates the machines-up gauge (a count over all would make a
        # round of heartbeats O(n²)).
        self._watched_n: dict[str, int] = {}
        self._down_n: dict[str, int] = {}

    def _set_down(self, key: MachineKey, watch: _Watch, down: bool) -> None:
        if watch.down != down:
            self._down_n[key[0]] = self._down_n.get(key[0], 0) + (1 if down else -1)
            watch.down = down

    def _schedule(self, key: MachineKey, watch: _Watch) -> None:
        watch.version += 1
        heapq.heappush(self._heap, (watch.deadline, watch.version, key))
        # Every heartbeat adds an entry; rebuild when stale ones dominate so the heap
        # stays proportional to the number of machines.
        if len(self._heap) > 4 * len(self._watches) + 64:
            self._heap = [
                (w.deadline, w.version, k) for k, w in self._watches.items() if not w.down
            ]
            heapq.heapify(self._heap)

    def watch(self, job: str, machine: str, now: float) -> bool:
        """Starts watching a machine (no-op when already watched); True when new."""
        key = (job, machine)
        if key in self._watches:
            return False
        heard = self._heard.pop(key, None)
        if heard is not None and now - heard.at < self.timeout_s:
            watch = _Watch(
                since=now,
                deadline=heard.at + self.timeout_s,
                last_seen=heard.at,
                last_seq=heard.seq,
                last_sent_ts=heard.sent_ts,
            )
        else:
            watch = _Watch(since=now, deadline=now + self.grace_s)
        self._watches[key] = watch
        self._watched_n[job] = self._watched_n.get(job, 0) + 1
        self._schedule(key, watch)
        return True

    def due_in(self, job: str, machine: str, now: float) -> float:
        """Seconds until a watched machine's deadline (KeyError when not watched)."""
        return self._watches[(job, machine)].deadline - now

    def unwatch(self, job: str, machine: str) -> None:
        watch = self._watches.pop((job, machine), None)
        if watch is not None:
            self._watched_n[job] -= 1
            self._down_n[job] = self._down_n.get(job, 0) - watch.down

    def watched(self, job: str | None = None) -> list[MachineKey]:
        return [k for k in self._watches if job is None or k[0] == job]

    def watched_count(self, job: str) -> int:
        return self._watched_n.get(job, 0)

    def is_watched(self, job: str, machine: str) -> bool:
        return (job, machine) in self._watches

    def mark_down(self, job: str, machine: str) -> None:
        """Marks a machine as already reported (an incident restored after a restart)."""
        watch = self._watches.get((job, machine))
        if watch is not None:
            self._set_down((job, machine), watch, True)

    def beat(
        self, job: str, machine: str, seq: int, now: float, sent_ts: float | None = None
    ) -> bool:
        """Records a heartbeat; True when its machine was down and is back. A machine
        not watched is only remembered, should its watch begin soon."""
        key = (job, machine)
        watch = self._watches.get(key)
        if watch is None:
            self._heard[key] = _Heard(now, seq, sent_ts)
            self._heard.move_to_end(key)
            while len(self._heard) > HEARD_MAX:
                self._heard.popitem(last=False)
            return False
        recovered = watch.down
        self._set_down(key, watch, False)
        watch.last_seen = now
        watch.last_seq = seq
        watch.last_sent_ts = sent_ts
        watch.deadline = now + self.timeout_s
        self._schedule((job, machine), watch)
        return recovered

    def rebase(self, now: float) -> None:
        """The monitor could not hear anyone until `now` (it was cut off from the bus):
        no silence before `now` counts, so every machine not already down gets a full
        timeout (the grace, if it was never heard) from now."""
        for key, watch in self._watches.items():
            if not watch.down:
                wait = self.timeout_s if watch.last_seen is not None else self.grace_s
                watch.deadline = max(watch.deadline, now + wait)
                self._schedule(key, watch)

    def lapsed(self, now: float) -> list[Lapse]:
        """Machines whose deadline passed since the last call; each is reported once."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, version, key = heapq.heappop(self._heap)
            watch = self._watches.get(key)
            if watch is None or watch.version != version or watch.down:
                continue
            self._set_down(key, watch, True)
            start = watch.last_seen if watch.last_seen is not None else watch.since
            out.append(
                Lapse(
                    key[0],
                    key[1],
                    watch.last_seen,
                    watch.last_seq,
                    watch.last_sent_ts,
                    now - start,
                )
            )
        return out

    def up_count(self, job: str) -> int:
        """Watched machines of `job` not currently lapsed."""
        return self._watched_n.get(job, 0) - self._down_n.get(job, 0)


def abnormal_exits(heartbeat: Heartbeat) -> list[WorkerStatus]:
    """Workers the heartbeat reports as exited with a non-zero (or unknown) exit code.

    Exit code 0 is a worker that finished on purpose (a leaver's workers after the
    switch); anything else, including a signal (negative) or a code the sidecar could
    not read (None), is a failure.
    """
    return [w for w in heartbeat.workers if w.state == "exited" and w.exit_code != 0]
