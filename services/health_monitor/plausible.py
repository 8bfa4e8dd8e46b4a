"""Plausibility of well-formed signals, pure: what a machine may claim about others.

A signal is believed only from the machine it is about (the subject says who sent it,
and under `--auth` only that machine's credentials may publish there), and only if it
is plausible:

- a collective-error report blames a peer only if the reporter and the peer are both
  members of the named group *as the cluster state has it now* (a group of the layout
  and the machines holding its roles, or a transfer pair of an in-flight plan): a
  sidecar cannot fail a machine it shares no group with; nor a machine for closing a
  group that an in-flight recovery rebuilds, unless it is that recovery's leaver;
- a stall report (a voter's progress board names the ranks holding a step back) is
  believed only from a machine holding a role, about machines holding roles whose ranks
  they are and that share a group of the layout with the reporter (the peers a rank
  waits on in its collectives; every culprit of a real stall has such peers, and each
  of them reports it), only for a step the job has reached (at most `STALL_LEAD` past
  the furthest step any machine reported done: a voter waits on the step after its
  last) while no machine reported a step done for `STALL_QUIET_S`, and only while the
  step statistics agree: a machine that reported the step done was not holding it back. A machine may name itself (a rank of it voted, and its
  other rank is blocked or stuck): it can stop its own training anyway. A reporter's
  believed stalls are rate-limited (`ReportRate`), so that a compromised sidecar cannot
  burn the standby pool by reporting stall after stall;
- step statistics advance within bounds: a machine's step may run at most `max_lead`
  steps ahead of the other machines of the job (synchronous training keeps them within
  a step or two), so a stream that jumps to step 10,000,000 is not believed, and it
  cannot push the machine's history past the real steps that follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmover.messages import ClusterState, CollectiveErrorReport, StallReport
from trainmover.services.health_monitor.median import SortedMedian

HOLDING = ("active", "leaving", "joining")
"""Statuses whose machine is (or is about to be) a member of its groups."""


def group_machines(state: ClusterState, group: str) -> set[str] | None:
    """The machines in `group` now; None when the job has no group of that name."""
    layout = state.layout
    machines: set[str] = set()
    for plan in state.in_flight.values():
        for spec in [*plan.groups, *plan.transfers]:
            if spec.name == group:
                machines |= {ref.machine for ref in spec.members}
    if not layout.has_group(group):
        return machines or None
    for name, m in state.machines.items():
        if m.cell is None or m.status not in HOLDING:
            continue
        names = {
            layout.group_name(kind, role)
            for role in layout.roles_of(m.cell)
            for kind in layout.role_group_kinds
        }
        if group in names:
            machines.add(name)
    return machines


def collective_error_problem(state: ClusterState, report: CollectiveErrorReport) -> str | None:
    """Why `report` is not believed, or None when it is plausible."""
    if report.peer == report.machine:
        return f"{report.machine} blames itself: nothing to move"
    members = group_machines(state, report.group)
    if members is None:
        return f"job {state.job!r} has no group {report.group!r}"
    outside = sorted({report.machine, report.peer} - members)
    if outside:
        return (
            f"{', '.join(outside)} not in group {report.group!r} now "
            f"(its machines: {', '.join(sorted(members)) or 'none'}): "
            f"{report.machine} cannot blame {report.peer} for it"
        )
    for plan in state.in_flight.values():
        if plan.migration == "planned" or report.peer in plan.leavers():
            continue
        if any(spec.name == report.group for spec in plan.groups):
            # Its members drop the group's old connections to rebuild it: a peer seen
            # closing them is following the recovery. One that dies meanwhile is
            # reported by its own heartbeat (the worker's exit) or its silence.
            return (
                f"recovery {plan.plan_id[:8]} rebuilds {report.group!r}: "
                f"{report.peer} closing it is not a failure"
            )
    return None


#: Steps a stall report's step may lie past the furthest step a machine of the job
#: reported done: a voter waits on the step after its last, and the step statistics of
#: the last step or two may still be on their way.
STALL_LEAD = 2
#: Seconds without any step reported done before a stall is believed: a real report
#: came after its voters waited out the stall threshold (at least `runtime.stall_floor_s`,
#: 1.5 s) with no step done anywhere in the job; half of that leaves room for statistics
#: of the last step still on their way.
STALL_QUIET_S = 0.75


def peers_of(state: ClusterState, machine: str) -> set[str]:
    """The machines that share a group of the layout with `machine` now (itself too)."""
    m = state.machines.get(machine)
    if m is None or m.cell is None:
        return set()
    layout = state.layout
    peers = {machine}
    for role in layout.roles_of(m.cell):
        for kind in layout.role_group_kinds:
            peers |= group_machines(state, layout.group_name(kind, role)) or set()
    return peers


def stall_problem(
    state: ClusterState, report: StallReport, last_step: dict[str, int], quiet_s: float | None
) -> str | None:
    """Why `report` is not believed. `last_step`: each machine's last believed step;
    `quiet_s`: seconds since the last of them arrived (both empty after a restart of the
    monitor, when neither can be judged yet)."""
    layout = state.layout
    reporter = state.machines.get(report.machine)
    if reporter is None or reporter.cell is None or reporter.status not in HOLDING:
        return f"{report.machine} holds no role: it has no vote to wait on"
    if last_step and report.step > max(last_step.values()) + STALL_LEAD:
        return (
            f"step {report.step} is not the job's: its furthest machine reported step "
            f"{max(last_step.values())} done"
        )
    if quiet_s is not None and quiet_s < STALL_QUIET_S:
        return (
            f"the job is not stalled: a machine reported a step done {quiet_s:.2f}s ago "
            f"(a stalled job reports none for {STALL_QUIET_S:g}s)"
        )
    peers = peers_of(state, report.machine)
    for machine, ranks in sorted(report.culprits.items()):
        m = state.machines.get(machine)
        if m is None or m.cell is None or m.status not in HOLDING:
            return f"{machine} holds no role: it cannot hold step {report.step} back"
        own = {layout.global_rank(role) for role in layout.roles_of(m.cell)}
        if not set(ranks) <= own:
            return f"ranks {sorted(set(ranks) - own)} are not {machine}'s"
        if machine not in peers:
            return (
                f"{machine} shares no group with {report.machine}: "
                f"{report.machine} does not wait on it"
            )
        if last_step.get(machine, -1) >= report.step:
            return f"{machine} reported step {last_step[machine]} done: not held back"
    return None


@dataclass
class ReportRate:
    """How many distinct stalls (epoch, step) each reporter may have believed within a
    window; the repeats of one stall (a voter reports it at each threshold) are free."""

    burst: int = 3
    window_s: float = 300.0
    _seen: dict[tuple[str, str], dict[tuple[str, int], float]] = field(default_factory=dict)

    def check(self, job: str, reporter: str, epoch: str, step: int, now: float) -> str | None:
        """Why this stall of `reporter` is not believed now (None: it is, and counted)."""
        seen = self._seen.setdefault((job, reporter), {})
        for key in [k for k, at in seen.items() if now - at > self.window_s]:
            del seen[key]
        if (epoch, step) in seen:
            return None
        if len(seen) >= self.burst:
            return (
                f"{reporter} reported {len(seen)} stalls within {self.window_s:g}s "
                f"(at most {self.burst}): not believed until the oldest is {self.window_s:g}s old"
            )
        seen[(epoch, step)] = now
        return None


@dataclass
class StepBounds:
    """Each machine's last believed step in each job; judges the next one."""

    max_lead: int = 100
    _last: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Per job, the same steps sorted: the others' median is read, not recomputed.
    _sorted: dict[str, SortedMedian] = field(default_factory=dict)

    def check(self, job: str, machine: str, step: int) -> str | None:
        """Why `step` of `machine` is not believed (None: it is, and it is recorded)."""
        steps = self._last.setdefault(job, {})
        ordered = self._sorted.setdefault(job, SortedMedian())
        mine = steps.get(machine)
        reference = ordered.median(excluding=mine)
        if reference is not None and step > reference + self.max_lead:
            return (
                f"step {step} of {machine} is more than {self.max_lead} steps ahead of "
                f"the job (its other machines are at step {reference:g})"
            )
        ordered.replace(mine, step)
        steps[machine] = step
        return None

    def forget(self, job: str, machine: str) -> None:
        step = self._last.get(job, {}).pop(machine, None)
        if step is not None:
            self._sorted[job].remove(step)

    def last(self, job: str) -> dict[str, int]:
        """Each machine's last believed step in `job`."""
        return dict(self._last.get(job, {}))
