"""What every planner decision ends in: an Outcome, a refusal, a queued drain, or a Plan
from a choice of joiners (a free standby warm for the leaver's role type).

Pure functions of the ClusterState; trainmover.services.planner.decisions says when each
is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmover.messages import (
    ClusterState,
    DrainEvent,
    FailureEvent,
    MigrationProgress,
    Plan,
    PlanKind,
    QueuedEvent,
    RebalanceEvent,
    StragglerEvent,
    new_id,
)
from trainmover.runtime.plan import compute_delta
from trainmover.services.planner.cluster import (
    first_move,
    latest_generations,
    note,
    remember,
    set_machine,
)

Event = DrainEvent | FailureEvent | StragglerEvent | RebalanceEvent


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


def reject(state: ClusterState, event: Event, reason: str) -> Outcome:
    """`event` changes nothing but its record as handled; the progress says why."""
    state = remember(state, event.event_id, "rejected")
    return Outcome(state, progress=[note(state, event.event_id, "rejected", reason, event.machine)])


def queue(
    state: ClusterState,
    event: DrainEvent,
    leaver: str,
    reason: str,
    retries_left: int | None = None,
) -> Outcome:
    """`event` waits at the end of the queue (for a standby, or another migration)."""
    queued = QueuedEvent(
        event_id=event.event_id,
        machine=leaver,
        raw=event.model_dump_json(),
        retries_left=retries_left,
    )
    state = state.model_copy(update={"queued": [*state.queued, queued]})
    return Outcome(state, progress=[note(state, event.event_id, "queued", reason, leaver)])


def free_standby(
    state: ClusterState, leaver: str, exclude: frozenset[str] | set[str] = frozenset()
) -> str | None:
    """The first standby (by name), not in `exclude`, warm for `leaver`'s role type;
    None when none is free (or `leaver` holds no role)."""
    cell = state.machines[leaver].cell
    if cell is None:
        return None
    wanted = state.layout.role_type(cell.pp)
    # The least name, not the whole job sorted: each admission of a large job's start
    # asks, and sorting thousands of machines each time made that start O(n² log n).
    return min(
        (
            name
            for name, m in state.machines.items()
            if m.status == "standby" and wanted in m.warm_role_types and name not in exclude
        ),
        default=None,
    )


def pick_joiners(state: ClusterState, leavers: dict[str, str | None]) -> dict[str, str] | None:
    """leaver -> joiner: the one already chosen, else a free standby warm for its role
    type (no two leavers share one); None when the pool is short."""
    taken = {j for j in leavers.values() if j is not None}
    moves: dict[str, str] = {}
    for leaver, kept in sorted(leavers.items()):
        joiner = kept or free_standby(state, leaver, exclude=taken)
        if joiner is None:
            return None
        taken.add(joiner)
        moves[leaver] = joiner
    return moves


def make_plan(
    state: ClusterState,
    event_id: str,
    kind: PlanKind,
    moves: dict[str, str],
    sources: dict[str, str],
    now: float,
    deadline_ts: float | None,
    merged_events: dict[str, str] | None = None,
    supersedes: list[str] | None = None,
    full: bool = False,
    retries_left: int = 0,
) -> Outcome:
    """A new in-flight Plan moving each leaver of `moves` to its joiner, each restoring
    from `sources` (leaver -> the machine its state comes from: itself for a planned
    migration, a data-parallel replica for a failure; none for a checkpoint restart),
    with the delta of groups to rebuild at their next generations (`full`: every group
    of the job, the benchmark's ablation)."""
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
        generations=latest_generations(state),
        moves=moves,
        sources=replicas or None,
        restore="checkpoint" if kind == "checkpoint_restart" else "transfer",
        supersedes=supersedes,
        full=full,
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
        state_sources=delta.joiner_sources(),
        deadline_ts=deadline_ts,
        retries_left=retries_left,
        ts=now,
    )
    for leaver, joiner in moves.items():
        state = set_machine(state, leaver, status="leaving")
        state = set_machine(state, joiner, status="joining")
    state = state.model_copy(update={"in_flight": {**state.in_flight, plan_id: plan}})
    state = remember(state, event_id, plan_id)
    together = ", ".join(f"{leaver} -> {joiner}" for leaver, joiner in sorted(moves.items()))
    return Outcome(
        state,
        plans=[plan],
        progress=[
            note(state, event_id, "planned", f"{kind}: {together}", *first_move(moves), plan_id)
        ],
    )
