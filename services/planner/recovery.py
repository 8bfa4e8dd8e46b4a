"""Failures: an unplanned migration with state from a live data-parallel replica, or a
checkpoint restart when a failed role has none; one recovery superseding every plan in
flight; failures waiting for standbys; and a plan whose joiner died re-planned.

Pure functions of the ClusterState; the rules are in the docstring of
trainmover.services.planner.decisions.
"""

from __future__ import annotations

from trainmover.messages import (
    ClusterState,
    DrainEvent,
    FailureEvent,
    MachineState,
    MigrationProgress,
    Plan,
    PlanKind,
    QueuedEvent,
)
from trainmover.services.planner.cluster import (
    cancel_plan,
    failures_of,
    first_move,
    is_failure,
    note,
    plan_with_joiner,
    plan_with_leaver,
    remember,
    replica,
    set_machine,
)
from trainmover.services.planner.drain import abort_planned, plan_planned
from trainmover.services.planner.plans import Event, Outcome, make_plan, pick_joiners, reject


def on_failure(
    state: ClusterState, event: FailureEvent, current: MachineState, now: float
) -> Outcome:
    """A failure of `event`'s machine, in its current state: a standby or joiner leaves
    the pool (a joiner's plan is re-planned), an active or leaving one is recovered."""
    machine = event.machine
    if current.status in ("failed", "maintenance"):
        return reject(state, event, f"{machine} is already {current.status}")
    if current.status in ("standby", "joining"):
        outcome = retire_standby(state, event, "failed")
        # A joiner that dies takes its plan down with it; re-plan the leaver.
        plan = plan_with_joiner(state, machine)
        if plan is None:
            return outcome
        return replace_plan(outcome.state, plan, now, outcome)
    leaving_in = plan_with_leaver(state, machine) if current.status == "leaving" else None
    if current.status == "leaving" and leaving_in is None:
        # Leaving with no plan: a failure already waiting for a standby.
        return reject(state, event, f"{machine} is already failed and queued")
    if leaving_in is not None and leaving_in.migration != "planned":
        # Its recovery does not need it (its fence may well be what was reported).
        return reject(
            state, event, f"{machine} is already being recovered ({leaving_in.plan_id[:8]})"
        )
    return recover(state, [event], now)


def recover(state: ClusterState, failures: list[FailureEvent], now: float) -> Outcome:
    """One recovery for every failure not yet recovered: `failures`, those waiting in
    the queue for a standby, and the leavers of in-flight recoveries, whose plans (and
    every planned migration in flight) it supersedes. See the module docstring."""
    superseded = list(state.in_flight.values())
    waiting = [q for q in state.queued if is_failure(q)]
    failed = {f.machine for f in failures} | {q.machine for q in waiting}
    failed |= {m.leaver for p in superseded if p.migration != "planned" for m in p.moves}
    # leaver -> the joiner already chosen for it (None: pick one); failure event id ->
    # its machine, oldest first.
    leavers: dict[str, str | None] = {}
    events: dict[str, str] = {}
    progress: list[MigrationProgress] = []
    for plan in superseded:
        state = cancel_plan(state, plan)
        if plan.migration == "planned":
            state, aborted = abort_planned(state, plan, failed, leavers, now)
            progress.append(aborted)
        else:
            events.update(failures_of(plan))
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
    moves = pick_joiners(state, leavers)
    if moves is None:
        waiting_outcome = wait_for_standbys(state, leavers, events, failures, progress)
        waiting_outcome.cancelled += [p.plan_id for p in superseded]
        return waiting_outcome
    replicas = {leaver: replica(state, leaver, exclude=set(moves)) for leaver in moves}
    orphans = sorted(leaver for leaver, src in replicas.items() if src is None)
    kind: PlanKind = "checkpoint_restart" if orphans else "unplanned"
    sources = {} if orphans else {leaver: str(src) for leaver, src in replicas.items()}
    *older, newest = events
    outcome = make_plan(
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
            note(
                outcome.state,
                event_id,
                "planned",
                f"superseded by recovery {plan.plan_id[:8]}: {together}",
                *first_move(moves),
                plan.plan_id,
            )
        )
    if orphans:
        why = ", ".join(orphans)
        layout = state.layout
        if layout.dp_replicate == 1:
            cause = f"pure FSDP: DP={layout.dp} shards one copy" if layout.dp > 1 else "DP=1"
        else:
            cause = "every replica failed"
        outcome.progress.append(
            note(
                outcome.state,
                plan.event_id,
                "fallback",
                "falling back to checkpoint restart: no data-parallel replica of the "
                f"roles of {why} is alive ({cause})",
                *first_move(moves),
                plan.plan_id,
            )
        )
    outcome.progress[:0] = progress
    outcome.cancelled += [p.plan_id for p in superseded]
    return outcome


def wait_for_standbys(
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
            state = set_machine(state, kept, status="maintenance", warm_role_types=[])
        state = set_machine(state, leaver, status="leaving")
    for event_id, machine in events.items():
        raw = FailureEvent(
            event_id=event_id, job=state.job, machine=machine, reason="waiting for a standby"
        )
        queued.append(QueuedEvent(event_id=event_id, machine=machine, raw=raw.to_json().decode()))
        detail = "falling back to checkpoint restart: no warm standby free; waiting for a standby"
        status = "fallback" if event_id in new else "queued"
        progress.append(note(state, event_id, status, detail, machine))
    state = state.model_copy(update={"queued": queued})
    return Outcome(state, progress=progress)


def replace_plan(state: ClusterState, plan: Plan, now: float, outcome: Outcome) -> Outcome:
    """Re-plans `plan`'s event after its joiner was lost."""
    if plan.migration != "planned":
        # Its leavers are still failed: recover them again (with any other failure).
        replanned = recover(state, [], now)
        replanned.progress = outcome.progress + replanned.progress
        return replanned
    # Its stayers may have built (or still be building) its groups: the new plan
    # must not rendezvous under the same store prefixes.
    state = cancel_plan(state, plan)
    leaver = plan.moves[0].leaver
    state = set_machine(state, leaver, status="active")
    kind_event = DrainEvent(
        event_id=plan.event_id,
        job=state.job,
        machine=leaver,
        reason="re-plan: joiner failed",
    )
    replanned = plan_planned(state, kind_event, now, plan.retries_left)
    replanned.cancelled.append(plan.plan_id)
    replanned.progress = outcome.progress + replanned.progress
    return replanned


def retire_standby(state: ClusterState, event: Event, status: str) -> Outcome:
    """A standby (or joiner) leaves the pool with `status`."""
    assert event.machine is not None
    state = set_machine(state, event.machine, status=status, cell=None, warm_role_types=[])
    state = remember(state, event.event_id, "done")
    return Outcome(
        state,
        progress=[
            note(
                state,
                event.event_id,
                "done",
                f"standby {event.machine} left the pool ({status})",
                event.machine,
            )
        ],
    )
