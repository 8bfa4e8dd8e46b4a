"""The planner's decisions, as pure functions of (cluster state, input) -> new state + outputs.

No bus, no clock of its own, no I/O: the service feeds events, progress and heartbeats in
and publishes what comes out, so every rule here is unit-tested without processes.

Rules (../shared/DESIGN.md):
- drain: planned migration to a free standby warm for the leaver's role type; queued
  when none is free (and planned as soon as one is).
- failure: unplanned migration with state from a data-parallel replica; with no replica
  (DP=1) or no free standby, a checkpoint restart, and the outcome says which.
- straggler: planned migration if a standby is free and the machine is out of its
  cool-down; otherwise ignored (it is only slow).
- rebalance: planned migration of the named machine (or the slowest known one).
- an event for a machine already leaving, a duplicate event, an unknown machine: rejected
  with a reason, nothing changes. A failure of a standby removes it from the pool.
- failures at once / during a migration: a recovery involves every rank of the job, so
  at most one is in flight and nothing planned runs beside it. A failure while plans are
  in flight *supersedes* all of them with ONE recovery: the leavers of in-flight
  recoveries and the new one move together (each to its own joiner; joiners already
  chosen are kept), each from a live data-parallel replica, or all from the last
  checkpoint when some failed cell has no live replica left (both replicas died). A
  planned migration caught by it is aborted (its phase-1 groups are dropped by the
  recovery) and its event re-queued as a drain, unless its leaver is the one that died.
  Generations a cancelled plan claimed are never handed out again (their store
  prefixes may hold a half-built incarnation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmover.messages import (
    ClusterState,
    DrainEvent,
    FailureEvent,
    Heartbeat,
    MachineState,
    MigrationProgress,
    Plan,
    PlanKind,
    QueuedEvent,
    RebalanceEvent,
    StragglerEvent,
    decode_event,
    new_id,
)
from trainmover.runtime.layout import ROLE_GROUP_KINDS, Layout, MachineRole
from trainmover.runtime.plan import compute_delta
from trainmover.services.planner.pool import admit

Event = DrainEvent | FailureEvent | StragglerEvent | RebalanceEvent

HANDLED_MEMORY = 4096
"""How many handled event ids the state remembers, for duplicate detection."""


def role_type(layout: Layout, cell: MachineRole) -> str:
    """The warm-up class of a machine role: its pipeline stage's position."""
    if layout.pp == 1:
        return "only"
    if cell.pp == 0:
        return "first"
    return "last" if cell.pp == layout.pp - 1 else "middle"


def role_types(layout: Layout) -> list[str]:
    """Every distinct role type of the layout (what a standby warms up for)."""
    return sorted({role_type(layout, c) for c in layout.cells()})


@dataclass
class Outcome:
    """What one input changed: the new state, plans to publish, progress to report."""

    state: ClusterState
    plans: list[Plan] = field(default_factory=list)
    progress: list[MigrationProgress] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    """Plan ids superseded (a leaver died mid-migration): the executor aborts them."""
    refused: str = ""
    """Why an input changed nothing, where that is worth a log line (a heartbeat turned
    away from the pool)."""

    @property
    def changed(self) -> bool:
        return bool(self.plans or self.progress or self.cancelled)


class Planner:
    """Decision rules over one job's ClusterState. Each call returns a new state."""

    def __init__(
        self, straggler_cooldown_s: float = 300.0, members: frozenset[str] | None = None
    ) -> None:
        self.straggler_cooldown_s = straggler_cooldown_s
        #: The machines the job config names (active and standbys); None admits any name.
        self.members = members

    # --- events ----------------------------------------------------------------------

    def on_event(self, state: ClusterState, event: Event, now: float) -> Outcome:
        if event.event_id in state.handled:
            return Outcome(state)  # a redelivery or a retried publish: already decided
        state = _remember(state, event.event_id, "seen")
        if event.machine is None:
            # The service names the slowest machine before deciding; without step
            # statistics there is nothing to choose from.
            return self._reject(state, event, "no machine named and no step statistics yet")
        current = state.machines.get(event.machine)
        if current is None:
            return self._reject(state, event, f"unknown machine {event.machine!r}")
        if isinstance(event, FailureEvent):
            return self._on_failure(state, event, current, now)
        if current.status == "standby":
            # A standby holds no role; taking it out of the pool is its sidecar's stop,
            # not a migration (a drain that only marked it would be undone by its next
            # heartbeat).
            return self._reject(
                state,
                event,
                f"{event.machine} is a standby: nothing to drain (stop its sidecar to take "
                "it out of the pool)",
            )
        if current.status != "active":
            return self._reject(state, event, f"{event.machine} is already {current.status}")
        if any(q.machine == event.machine for q in state.queued):
            return self._reject(state, event, f"{event.machine} is already queued to leave")
        if isinstance(event, StragglerEvent):
            until = state.cooldown_until.get(event.machine, 0.0)
            if now < until:
                return self._reject(
                    state, event, f"{event.machine} moved recently (cool-down until {until:.0f})"
                )
        return self._plan_planned(state, event, now)

    def _plan_planned(self, state: ClusterState, event: Event, now: float) -> Outcome:
        assert event.machine is not None
        leaver = event.machine
        busy = _rebuilding(state, leaver)
        if busy is not None:
            # Two plans must never rebuild one group at once (both would claim its next
            # generation), nor involve one rank twice (a rank runs one migration at a
            # time): a drain waits for the other migration, anything else is dropped.
            reason = f"migration {busy.plan_id[:8]} involves {leaver}'s groups"
            if isinstance(event, DrainEvent):
                return self._queue(state, event, leaver, f"{reason}: the drain waits")
            return self._reject(state, event, reason)
        joiner = self._free_standby(state, leaver)
        if joiner is None:
            if isinstance(event, DrainEvent):
                return self._queue(state, event, leaver, "no warm standby free: the drain waits")
            return self._reject(state, event, "no warm standby free")
        deadline = None
        if isinstance(event, DrainEvent) and event.deadline_s is not None:
            deadline = event.ts + event.deadline_s
        return self._make_plan(
            state, event.event_id, "planned", {leaver: joiner}, {leaver: leaver}, now, deadline
        )

    def _on_failure(
        self, state: ClusterState, event: FailureEvent, current: MachineState, now: float
    ) -> Outcome:
        machine = event.machine
        if current.status in ("failed", "maintenance"):
            return self._reject(state, event, f"{machine} is already {current.status}")
        if current.status in ("standby", "joining"):
            outcome = self._retire_standby(state, event, "failed")
            # A joiner that dies takes its plan down with it; re-plan the leaver.
            plan = _plan_with_joiner(state, machine)
            if plan is None:
                return outcome
            return self._replace_plan(outcome.state, plan, now, outcome)
        leaving_in = _plan_with_leaver(state, machine) if current.status == "leaving" else None
        if current.status == "leaving" and leaving_in is None:
            # Leaving with no plan: a failure already waiting for a standby.
            return self._reject(state, event, f"{machine} is already failed and queued")
        if leaving_in is not None and leaving_in.migration != "planned":
            # Its recovery does not need it (its fence may well be what was reported).
            return self._reject(
                state, event, f"{machine} is already being recovered ({leaving_in.plan_id[:8]})"
            )
        return self._recover(state, [event], now)

    def _recover(self, state: ClusterState, failures: list[FailureEvent], now: float) -> Outcome:
        """One recovery for every failure not yet recovered: `failures`, those waiting in
        the queue for a standby, and the leavers of in-flight recoveries, whose plans (and
        every planned migration in flight) it supersedes. See the module docstring."""
        superseded = list(state.in_flight.values())
        waiting = [q for q in state.queued if _is_failure(q)]
        failed = {f.machine for f in failures} | {q.machine for q in waiting}
        failed |= {m.leaver for p in superseded if p.migration != "planned" for m in p.moves}
        # leaver -> the joiner already chosen for it (None: pick one); failure event id ->
        # its machine, oldest first.
        leavers: dict[str, str | None] = {}
        events: dict[str, str] = {}
        progress: list[MigrationProgress] = []
        for plan in superseded:
            state = _cancel_plan(state, plan)
            if plan.migration == "planned":
                state, note = self._abort_planned(state, plan, failed, leavers, now)
                progress.append(note)
            else:
                events.update(_failures_of(plan))
                for move in plan.moves:
                    leavers[move.leaver] = move.joiner
        state = state.model_copy(update={"queued": [q for q in state.queued if q not in waiting]})
        for queued in waiting:
            events[queued.event_id] = queued.machine
            leavers.setdefault(queued.machine, None)
        for event in failures:
            events[event.event_id] = event.machine
            leavers.setdefault(event.machine, None)
        # A joiner is kept only while it is alive and still joining.
        for leaver, kept in leavers.items():
            if kept is not None and state.machines[kept].status != "joining":
                leavers[leaver] = None
        moves = self._pick_joiners(state, leavers)
        if moves is None:
            waiting_outcome = self._wait_for_standbys(state, leavers, events, failures, progress)
            waiting_outcome.cancelled += [p.plan_id for p in superseded]
            return waiting_outcome
        replicas = {leaver: _replica(state, leaver, exclude=set(moves)) for leaver in moves}
        orphans = sorted(leaver for leaver, src in replicas.items() if src is None)
        kind: PlanKind = "checkpoint_restart" if orphans else "unplanned"
        sources = {} if orphans else {leaver: str(src) for leaver, src in replicas.items()}
        *older, newest = events
        outcome = self._make_plan(
            state,
            newest,
            kind,
            moves,
            sources,
            now,
            None,
            merged_events={e: events[e] for e in older},
            supersedes=[p.plan_id for p in superseded],
        )
        plan = outcome.plans[0]
        together = ", ".join(f"{leaver} -> {joiner}" for leaver, joiner in sorted(moves.items()))
        for event_id in older:
            outcome.progress.append(
                _progress(
                    outcome.state,
                    event_id,
                    "planned",
                    f"superseded by recovery {plan.plan_id[:8]}: {together}",
                    *_first_move(moves),
                    plan.plan_id,
                )
            )
        if orphans:
            why = ", ".join(orphans)
            outcome.progress.append(
                _progress(
                    outcome.state,
                    plan.event_id,
                    "fallback",
                    "falling back to checkpoint restart: no data-parallel replica of the "
                    f"roles of {why} is alive (DP=1, or every replica failed)",
                    *_first_move(moves),
                    plan.plan_id,
                )
            )
        outcome.progress[:0] = progress
        outcome.cancelled += [p.plan_id for p in superseded]
        return outcome

    def _abort_planned(
        self,
        state: ClusterState,
        plan: Plan,
        failed: set[str],
        leavers: dict[str, str | None],
        now: float,
    ) -> tuple[ClusterState, MigrationProgress]:
        """A planned migration caught by a recovery: the recovery drops its phase-1 groups
        on every rank. A joiner whose leaver failed is kept for the same cell (it prepared
        exactly that role); any other joiner may hold a role already, so it goes through
        maintenance (its sidecar relaunches it as a standby). A live leaver keeps its role
        and its event waits in the queue, as a drain, to run again."""
        for move in plan.moves:
            if move.leaver in failed:
                leavers[move.leaver] = move.joiner
                continue
            state = _set_machine(state, move.leaver, status="active")
            if state.machines[move.joiner].status == "joining":
                state = _set_machine(state, move.joiner, status="maintenance", warm_role_types=[])
        cause = ", ".join(sorted(failed))
        first = plan.moves[0]
        if first.leaver in failed:
            return state, _progress(
                state,
                plan.event_id,
                "aborted",
                f"the leaver failed mid-migration ({cause}): recovering from a replica instead",
                first.leaver,
                first.joiner,
                plan.plan_id,
            )
        deadline_s = None if plan.deadline_ts is None else max(1.0, plan.deadline_ts - now)
        again = DrainEvent(
            event_id=plan.event_id,
            job=state.job,
            machine=first.leaver,
            reason=f"re-queued: aborted by the failure of {cause}",
            source="planner",
            deadline_s=deadline_s,
            ts=now,
        )
        queued = QueuedEvent(
            event_id=again.event_id, machine=first.leaver, raw=again.to_json().decode()
        )
        state = state.model_copy(update={"queued": [queued, *state.queued]})
        return state, _progress(
            state,
            plan.event_id,
            "queued",
            f"aborted by the failure of {cause}: the drain waits and runs again",
            first.leaver,
            None,
            plan.plan_id,
        )

    def _pick_joiners(
        self, state: ClusterState, leavers: dict[str, str | None]
    ) -> dict[str, str] | None:
        """leaver -> joiner: the one already chosen, else a free standby warm for its role
        type (no two leavers share one); None when the pool is short."""
        taken = {j for j in leavers.values() if j is not None}
        moves: dict[str, str] = {}
        for leaver, kept in sorted(leavers.items()):
            joiner = kept or self._free_standby(state, leaver, exclude=taken)
            if joiner is None:
                return None
            taken.add(joiner)
            moves[leaver] = joiner
        return moves

    def _wait_for_standbys(
        self,
        state: ClusterState,
        leavers: dict[str, str | None],
        events: dict[str, str],
        failures: list[FailureEvent],
        progress: list[MigrationProgress],
    ) -> Outcome:
        """The pool is short: every failure waits in the queue (the job cannot run without
        the roles either way) and is recovered as one when standbys are free. Joiners
        already chosen may hold their roles, so they go through maintenance."""
        new = {f.event_id for f in failures}
        queued = list(state.queued)
        for leaver, kept in sorted(leavers.items()):
            if kept is not None:
                state = _set_machine(state, kept, status="maintenance", warm_role_types=[])
            state = _set_machine(state, leaver, status="leaving")
        for event_id, machine in events.items():
            raw = FailureEvent(
                event_id=event_id, job=state.job, machine=machine, reason="waiting for a standby"
            )
            queued.append(
                QueuedEvent(event_id=event_id, machine=machine, raw=raw.to_json().decode())
            )
            detail = (
                "falling back to checkpoint restart: no warm standby free; waiting for a standby"
            )
            status = "fallback" if event_id in new else "queued"
            progress.append(_progress(state, event_id, status, detail, machine))
        state = state.model_copy(update={"queued": queued})
        return Outcome(state, progress=progress)

    def _replace_plan(
        self, state: ClusterState, plan: Plan, now: float, outcome: Outcome
    ) -> Outcome:
        """Re-plans `plan`'s event after its joiner was lost."""
        if plan.migration != "planned":
            # Its leavers are still failed: recover them again (with any other failure).
            replanned = self._recover(state, [], now)
            replanned.progress = outcome.progress + replanned.progress
            return replanned
        # Its stayers may have built (or still be building) its groups: the new plan
        # must not rendezvous under the same store prefixes.
        state = _cancel_plan(state, plan)
        leaver = plan.moves[0].leaver
        state = _set_machine(state, leaver, status="active")
        kind_event = DrainEvent(
            event_id=plan.event_id,
            job=state.job,
            machine=leaver,
            reason="re-plan: joiner failed",
        )
        replanned = self._plan_planned(state, kind_event, now)
        replanned.cancelled.append(plan.plan_id)
        replanned.progress = outcome.progress + replanned.progress
        return replanned

    def _retire_standby(self, state: ClusterState, event: Event, status: str) -> Outcome:
        assert event.machine is not None
        state = _set_machine(state, event.machine, status=status, cell=None, warm_role_types=[])
        state = _remember(state, event.event_id, "done")
        return Outcome(
            state,
            progress=[
                _progress(
                    state,
                    event.event_id,
                    "done",
                    f"standby {event.machine} left the pool ({status})",
                    event.machine,
                )
            ],
        )

    def _queue(self, state: ClusterState, event: DrainEvent, leaver: str, reason: str) -> Outcome:
        queued = QueuedEvent(event_id=event.event_id, machine=leaver, raw=event.model_dump_json())
        state = state.model_copy(update={"queued": [*state.queued, queued]})
        return Outcome(state, progress=[_progress(state, event.event_id, "queued", reason, leaver)])

    def _reject(self, state: ClusterState, event: Event, reason: str) -> Outcome:
        state = _remember(state, event.event_id, "rejected")
        return Outcome(
            state, progress=[_progress(state, event.event_id, "rejected", reason, event.machine)]
        )

    # --- plans -----------------------------------------------------------------------

    def _free_standby(
        self, state: ClusterState, leaver: str, exclude: frozenset[str] | set[str] = frozenset()
    ) -> str | None:
        cell = state.machines[leaver].cell
        assert cell is not None
        wanted = role_type(state.layout, cell)
        free = [
            name
            for name, m in sorted(state.machines.items())
            if m.status == "standby" and wanted in m.warm_role_types and name not in exclude
        ]
        return free[0] if free else None

    def _make_plan(
        self,
        state: ClusterState,
        event_id: str,
        kind: PlanKind,
        moves: dict[str, str],
        sources: dict[str, str],
        now: float,
        deadline_ts: float | None,
        merged_events: dict[str, str] | None = None,
        supersedes: list[str] | None = None,
    ) -> Outcome:
        plan_id = new_id()
        assignment = {
            n: m.cell
            for n, m in state.machines.items()
            if m.cell is not None and m.status in ("active", "leaving")
        }
        replicas = {leaver: src for leaver, src in sources.items() if src != leaver}
        delta = compute_delta(
            job=state.job,
            plan_id=plan_id,
            layout=state.layout,
            assignment=assignment,
            generations=_generations(state),
            moves=moves,
            sources=replicas or None,
            restore="checkpoint" if kind == "checkpoint_restart" else "transfer",
            supersedes=supersedes,
        )
        plan = Plan(
            plan_id=plan_id,
            job=state.job,
            event_id=event_id,
            migration=kind,
            moves=delta.moves,
            groups=delta.groups,
            transfers=delta.transfers,
            restore=delta.restore,
            supersedes=delta.supersedes,
            merged_events=merged_events or {},
            state_sources=sources,
            deadline_ts=deadline_ts,
            ts=now,
        )
        for leaver, joiner in moves.items():
            state = _set_machine(state, leaver, status="leaving")
            state = _set_machine(state, joiner, status="joining")
        state = state.model_copy(update={"in_flight": {**state.in_flight, plan_id: plan}})
        state = _remember(state, event_id, plan_id)
        together = ", ".join(f"{leaver} -> {joiner}" for leaver, joiner in sorted(moves.items()))
        return Outcome(
            state,
            plans=[plan],
            progress=[
                _progress(
                    state, event_id, "planned", f"{kind}: {together}", *_first_move(moves), plan_id
                )
            ],
        )

    # --- progress from the executor -----------------------------------------------------

    def on_progress(self, state: ClusterState, progress: MigrationProgress, now: float) -> Outcome:
        """Applies the end of a migration to the state. A planned migration ends for the
        job at `releasing`: every rank has switched, and what is left (the leaver's
        workers exiting) cannot undo it, so a leaver dying then is not a failure of the
        migration. Other non-terminal progress is ignored."""
        plan = state.in_flight.get(progress.plan_id or "")
        if plan is None or progress.state not in ("done", "releasing", "failed", "aborted"):
            return Outcome(state)
        if progress.state in ("done", "releasing"):
            state = _drop_plan(state, plan, restore_joiner=False)
            generations = dict(state.generations)
            for spec in plan.groups:
                generations[spec.name] = spec.generation
            state = state.model_copy(update={"generations": generations})
            for move in plan.moves:
                leaver = state.machines[move.leaver]
                after = "failed" if plan.migration != "planned" else "maintenance"
                state = _set_machine(
                    state, move.joiner, status="active", cell=move.cell, warm_role_types=[]
                )
                if leaver.status == "leaving":
                    state = _set_machine(
                        state, move.leaver, status=after, cell=None, warm_role_types=[]
                    )
                state = state.model_copy(
                    update={
                        "cooldown_until": {
                            **state.cooldown_until,
                            move.joiner: now + self.straggler_cooldown_s,
                        }
                    }
                )
            return self._serve_queue(Outcome(state), now)
        # Failed or aborted: the executor rolled phase 1 back; the leaver keeps its role
        # (planned) and the joiner goes back to the pool.
        # Its ranks may have built (or claimed) its groups: their generations stay claimed.
        # Its joiner may hold the role already: the executor has its sidecar relaunch it,
        # through maintenance, and it returns to the pool once warm.
        state = _claim_generations(_drop_plan(state, plan, restore_joiner=False), plan)
        for move in plan.moves:
            if state.machines[move.leaver].status == "leaving":
                state = _set_machine(state, move.leaver, status="active")
            if state.machines[move.joiner].status == "joining":
                state = _set_machine(state, move.joiner, status="maintenance", warm_role_types=[])
        return self._serve_queue(Outcome(state), now)

    # --- standby pool ------------------------------------------------------------------

    def on_heartbeat(self, state: ClusterState, beat: Heartbeat, now: float) -> Outcome:
        """Admits a warm, healthy machine to the standby pool (`pool.admit`); then serves
        queued drains."""
        admission = admit(state, beat, set(role_types(state.layout)), self.members)
        if admission.machine is None:
            return Outcome(state, refused=admission.reason)
        machines = {**state.machines, beat.machine: admission.machine}
        outcome = Outcome(state.model_copy(update={"machines": machines}), progress=[])
        return self._serve_queue(outcome, now)

    def _serve_queue(self, outcome: Outcome, now: float) -> Outcome:
        state = outcome.state
        while state.queued:
            head, rest = state.queued[0], state.queued[1:]
            leaver_state = state.machines.get(head.machine)
            if leaver_state is None or leaver_state.status not in ("active", "leaving"):
                state = state.model_copy(update={"queued": rest})
                continue
            event = decode_event(head.raw)
            if isinstance(event, FailureEvent):
                # Every failure waiting is recovered at once, when there is a standby for each.
                waiting: dict[str, str | None] = {
                    q.machine: None for q in state.queued if _is_failure(q)
                }
                if self._pick_joiners(state, waiting) is None:
                    break
                planned = self._recover(state, [], now)
            else:
                if self._free_standby(state, head.machine) is None or _rebuilding(
                    state, head.machine
                ):
                    break
                state = state.model_copy(update={"queued": rest})
                planned = self._plan_planned(state, event, now)
            state = planned.state
            outcome.plans += planned.plans
            outcome.progress += planned.progress
        outcome.state = state
        return outcome


# --- helpers over ClusterState ------------------------------------------------------------


def _set_machine(state: ClusterState, name: str, **changes: object) -> ClusterState:
    current = state.machines.get(name) or MachineState(status="standby")
    machines = {**state.machines, name: current.model_copy(update=changes)}
    return state.model_copy(update={"machines": machines})


def _remember(state: ClusterState, event_id: str, outcome: str) -> ClusterState:
    handled = {**state.handled, event_id: outcome}
    while len(handled) > HANDLED_MEMORY:
        handled.pop(next(iter(handled)))
    return state.model_copy(update={"handled": handled})


def _drop_plan(state: ClusterState, plan: Plan, restore_joiner: bool) -> ClusterState:
    in_flight = {k: v for k, v in state.in_flight.items() if k != plan.plan_id}
    state = state.model_copy(update={"in_flight": in_flight})
    if restore_joiner:
        for move in plan.moves:
            if state.machines[move.joiner].status == "joining":
                state = _set_machine(state, move.joiner, status="standby")
    return state


def _rebuilding(state: ClusterState, machine: str) -> Plan | None:
    """An in-flight plan that a migration of `machine` would collide with, if any: one
    with a machine in common with the groups of `machine`'s role (a rank takes part in
    one migration at a time, even where the two plans' groups differ). A recovery counts
    for every machine: every rank of the job takes part in it."""
    recovery = next((p for p in state.in_flight.values() if p.migration != "planned"), None)
    if recovery is not None:
        return recovery
    cell = state.machines[machine].cell
    if cell is None:
        return None
    layout = state.layout
    cells = {
        (member.dp, member.pp)
        for role in layout.roles_of(cell)
        for kind in ROLE_GROUP_KINDS
        for member in layout.group_members(kind, role)
    }
    mine = {
        name
        for name, m in state.machines.items()
        if m.cell is not None and (m.cell.dp, m.cell.pp) in cells
    }
    return next(
        (
            p
            for p in state.in_flight.values()
            if mine & {ref.machine for g in p.groups for ref in g.members}
        ),
        None,
    )


def _plan_with_leaver(state: ClusterState, machine: str) -> Plan | None:
    return next(
        (p for p in state.in_flight.values() if any(m.leaver == machine for m in p.moves)), None
    )


def _plan_with_joiner(state: ClusterState, machine: str) -> Plan | None:
    return next(
        (p for p in state.in_flight.values() if any(m.joiner == machine for m in p.moves)), None
    )


def _replica(state: ClusterState, leaver: str, exclude: set[str]) -> str | None:
    """An active machine, not in `exclude` (the other leavers), holding the same pipeline
    stage in another DP replica."""
    cell = state.machines[leaver].cell
    assert cell is not None
    for name, m in sorted(state.machines.items()):
        if (
            name != leaver
            and name not in exclude
            and m.status == "active"
            and m.cell is not None
            and m.cell.pp == cell.pp
            and m.cell.dp != cell.dp
        ):
            return name
    return None


def _generations(state: ClusterState) -> dict[str, int]:
    """Per group, the highest generation built or claimed: a new plan takes the next."""
    return {
        name: max(state.generations.get(name, 0), state.claimed_generations.get(name, 0))
        for name in state.layout.all_groups()
    }


def _cancel_plan(state: ClusterState, plan: Plan) -> ClusterState:
    """Drops a superseded plan; its groups' generations stay claimed (some ranks may have
    built them: a later incarnation must not reuse their store prefix)."""
    return _claim_generations(_drop_plan(state, plan, restore_joiner=False), plan)


def _claim_generations(state: ClusterState, plan: Plan) -> ClusterState:
    """The generations of `plan`'s groups are never handed out again."""
    claimed = dict(state.claimed_generations)
    for spec in plan.groups:
        claimed[spec.name] = max(claimed.get(spec.name, 0), spec.generation)
    return state.model_copy(update={"claimed_generations": claimed})


def _failures_of(plan: Plan) -> dict[str, str]:
    """A recovery's failure events -> the machine each reported (merged ones included)."""
    own = sorted(plan.leavers() - set(plan.merged_events.values())) or [plan.moves[0].leaver]
    return {**plan.merged_events, plan.event_id: own[0]}


def _is_failure(queued: QueuedEvent) -> bool:
    return isinstance(decode_event(queued.raw), FailureEvent)


def _first_move(moves: dict[str, str]) -> tuple[str, str]:
    """The (leaver, joiner) a progress message names (its `moves` lists them all)."""
    return min(moves.items())


def _progress(
    state: ClusterState,
    event_id: str,
    status: str,
    detail: str,
    leaver: str | None,
    joiner: str | None = None,
    plan_id: str | None = None,
) -> MigrationProgress:
    plan = state.in_flight.get(plan_id or "")
    moves = {m.leaver: m.joiner for m in plan.moves} if plan is not None else {}
    return MigrationProgress(
        job=state.job,
        event_id=event_id,
        plan_id=plan_id,
        state=status,  # type: ignore[arg-type]
        detail=detail,
        leaver=leaver,
        joiner=joiner,
        moves=moves,
    )
