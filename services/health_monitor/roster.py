"""The monitor's view of which machines exist and which to watch, from cluster states, pure.

The planner owns each job's ClusterState (JetStream KV, key STATE_KEY); the monitor
only reads it. `Roster.update` takes a new state and says what changed for watching:
machines that start or stop being watched, and machines the planner moved to a status
where their open incidents are settled (failed, maintenance, or gone from the state).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trainmover.messages import ClusterState, MachineStatus

DEFAULT_WATCHED: frozenset[str] = frozenset({"active", "standby", "leaving"})
"""Statuses whose machines are watched: a dead standby, or a leaver that dies mid-way
through a migration, is an event too. failed/maintenance machines are already settled."""


@dataclass
class RosterChange:
    """What one new cluster state changed, per machine name."""

    job: str
    started: list[str] = field(default_factory=list)
    """Now watched, and not before (new machine, or re-admitted after repair)."""
    stopped: list[str] = field(default_factory=list)
    """Watched before, not now."""
    settled: list[str] = field(default_factory=list)
    """Now in an unwatched status or removed (the planner acted): incidents close."""
    status_changed: list[str] = field(default_factory=list)


class Roster:
    """Latest cluster state of every configured job."""

    def __init__(self, jobs: Iterable[str], watched: Iterable[str] = DEFAULT_WATCHED) -> None:
        self.jobs: list[str] = list(dict.fromkeys(jobs))
        self.watched_statuses = frozenset(watched)
        self._states: dict[str, ClusterState] = {}

    def loaded(self, job: str) -> bool:
        return job in self._states

    @property
    def all_loaded(self) -> bool:
        return all(j in self._states for j in self.jobs)

    def state(self, job: str) -> ClusterState | None:
        return self._states.get(job)

    def status(self, job: str, machine: str) -> MachineStatus | None:
        state = self._states.get(job)
        if state is None:
            return None
        entry = state.machines.get(machine)
        return entry.status if entry else None

    def is_watched(self, job: str, machine: str) -> bool:
        return self.status(job, machine) in self.watched_statuses

    def watched(self, job: str) -> list[str]:
        state = self._states.get(job)
        if state is None:
            return []
        return [m for m, s in state.machines.items() if s.status in self.watched_statuses]

    def active(self, job: str) -> set[str]:
        state = self._states.get(job)
        return {m for m, s in state.machines.items() if s.status == "active"} if state else set()

    def jobs_of(self, machine: str) -> list[str]:
        """The loaded jobs that have a machine of that name (normally one)."""
        return [j for j, s in self._states.items() if machine in s.machines]

    def update(self, state: ClusterState) -> RosterChange:
        """Installs a job's new state; an older revision than the one held is ignored."""
        job = state.job
        change = RosterChange(job)
        old = self._states.get(job)
        if old is not None and state.revision < old.revision:
            return change
        self._states[job] = state
        before = {m: s.status for m, s in old.machines.items()} if old else {}
        after = {m: s.status for m, s in state.machines.items()}
        for machine in sorted(set(before) | set(after)):
            was, now = before.get(machine), after.get(machine)
            if was == now:
                continue
            change.status_changed.append(machine)
            was_watched = was in self.watched_statuses
            now_watched = now in self.watched_statuses
            if now_watched and not was_watched:
                change.started.append(machine)
            if was_watched and not now_watched:
                change.stopped.append(machine)
            if not now_watched:
                change.settled.append(machine)
        return change
