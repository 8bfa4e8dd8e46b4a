"""Planned migrations: a drain, a straggler or a rebalance moves its leaver's role to a
free warm standby, with the leaver's own state (a drain waits when it cannot run yet);
and what becomes of a planned migration that a failure's recovery catches in flight.

Pure functions of the ClusterState (see trainmover.services.planner.decisions).
"""

from __future__ import annotations

from trainmover.messages import (
    ClusterState,
    DrainEvent,
    MigrationProgress,
    Plan,
    QueuedEvent,
    StragglerEvent,
)
from trainmover.services.planner.cluster import note, rebuilding, set_machine
from trainmover.services.planner.plans import Event, Outcome, free_standby, make_plan, queue, reject

#: How many times a drain or rebalance is planned again after its migration failed
#: before the switch (a group build that failed, the store lost in phase 1): the
#: operator asked for the machine to go. A straggler is proposed again if still slow.
PLANNED_RETRIES = 2


def plan_planned(
    state: ClusterState, event: Event, now: float, retries_left: int | None = None
) -> Outcome:
    """A planned migration of `event`'s machine to a free warm standby, with its own
    state; a drain queues when the standby or the machine's groups are not free yet.
    `retries_left`: the event's tries left (None: a new event's)."""
    assert event.machine is not None
    if retries_left is None:
        retries_left = 0 if isinstance(event, StragglerEvent) else PLANNED_RETRIES
    leaver = event.machine
    busy = rebuilding(state, leaver)
    if busy is not None:
        # Two plans must never rebuild one group at once (both would claim its next
        # generation), nor involve one rank twice (a rank runs one migration at a
        # time): a drain waits for the other migration, anything else is dropped.
        reason = f"migration {busy.plan_id[:8]} involves {leaver}'s groups"
        if isinstance(event, DrainEvent):
            return queue(state, event, leaver, f"{reason}: the drain waits", retries_left)
        return reject(state, event, reason)
    joiner = free_standby(state, leaver)
    if joiner is None:
        if isinstance(event, DrainEvent):
            return queue(
                state, event, leaver, "no warm standby free: the drain waits", retries_left
            )
        return reject(state, event, "no warm standby free")
    deadline = None
    if isinstance(event, DrainEvent) and event.deadline_s is not None:
        deadline = event.ts + event.deadline_s
    return make_plan(
        state,
        event.event_id,
        "planned",
        {leaver: joiner},
        {leaver: leaver},
        now,
        deadline,
        retries_left=retries_left,
    )


def abort_planned(
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
        state = set_machine(state, move.leaver, status="active")
        if state.machines[move.joiner].status == "joining":
            state = set_machine(state, move.joiner, status="maintenance", warm_role_types=[])
    cause = ", ".join(sorted(failed))
    first = plan.moves[0]
    if first.leaver in failed:
        return state, note(
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
    state = requeue(state, again, plan.retries_left)
    return state, note(
        state,
        plan.event_id,
        "queued",
        f"aborted by the failure of {cause}: the drain waits and runs again",
        first.leaver,
        None,
        plan.plan_id,
    )


def retry_planned(state: ClusterState, plan: Plan, progress: MigrationProgress) -> Outcome:
    """A planned migration failed before its switch (the executor said `retrying`) and
    was rolled back: its event waits at the head of the queue, as a drain, with one try
    less; if its leaver no longer trains (it failed meanwhile), it ends `failed`."""
    leaver = plan.moves[0].leaver
    status = state.machines[leaver].status
    if status != "active":
        why = f"{progress.detail}; {leaver} is {status} now: not planned again"
        return Outcome(state, progress=[note(state, plan.event_id, "failed", why, leaver)])
    again = DrainEvent(
        event_id=plan.event_id,
        job=state.job,
        machine=leaver,
        reason=f"planned again: {progress.detail}"[:4096],
        source="planner",
    )
    state = requeue(state, again, plan.retries_left - 1)
    why = f"failed before its switch ({progress.detail}): planned again"
    return Outcome(state, progress=[note(state, plan.event_id, "queued", why[:4096], leaver)])


def requeue(state: ClusterState, event: DrainEvent, retries_left: int) -> ClusterState:
    """`event` first in the queue: it was planned before and runs again next."""
    queued = QueuedEvent(
        event_id=event.event_id,
        machine=event.machine,
        raw=event.to_json().decode(),
        retries_left=max(0, retries_left),
    )
    return state.model_copy(update={"queued": [queued, *state.queued]})
