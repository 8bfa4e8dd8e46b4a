"""Pure reads and edits of a job's ClusterState that every planner decision shares.

Machine status changes, remembered event ids, in-flight plans and the generations they
claim, the data-parallel replica of a role, and the progress notes the planner reports.
No rule lives here: the decision modules (trainmover.services.planner.decisions and the
modules it calls) say when each edit is made.
"""

from __future__ import annotations

from trainmover.messages import (
    ClusterState,
    FailureEvent,
    MachineState,
    MigrationProgress,
    Plan,
    QueuedEvent,
    decode_event,
)
from trainmover.runtime.config import JobConfig

HANDLED_MEMORY = 4096
"""How many handled event ids the state remembers, for duplicate detection."""


def initial_state(config: JobConfig) -> ClusterState:
    """A job's first state: its machines active in layout order; standbys join on warm-up."""
    machines = {
        name: MachineState(status="active", cell=cell)
        for name, cell in zip(config.cluster.machines, config.layout.cells(), strict=True)
    }
    return ClusterState(job=config.job, layout=config.layout, machines=machines)


def set_machine(state: ClusterState, name: str, **changes: object) -> ClusterState:
    """`name`'s machine state with `changes` applied (a new standby if unknown)."""
    current = state.machines.get(name) or MachineState(status="standby")
    machines = {**state.machines, name: current.model_copy(update=changes)}
    return state.model_copy(update={"machines": machines})


def remember(state: ClusterState, event_id: str, outcome: str) -> ClusterState:
    """Records how event `event_id` was handled; the oldest records are forgotten."""
    handled = {**state.handled, event_id: outcome}
    while len(handled) > HANDLED_MEMORY:
        handled.pop(next(iter(handled)))
    return state.model_copy(update={"handled": handled})


def drop_plan(state: ClusterState, plan: Plan, restore_joiner: bool) -> ClusterState:
    """`plan` no longer in flight (with `restore_joiner`, its joiners back to standby)."""
    in_flight = {k: v for k, v in state.in_flight.items() if k != plan.plan_id}
    state = state.model_copy(update={"in_flight": in_flight})
    if restore_joiner:
        for move in plan.moves:
            if state.machines[move.joiner].status == "joining":
                state = set_machine(state, move.joiner, status="standby")
    return state


def rebuilding(state: ClusterState, machine: str) -> Plan | None:
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
        for kind in layout.role_group_kinds
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


def plan_with_leaver(state: ClusterState, machine: str) -> Plan | None:
    """The in-flight plan in which `machine` leaves, if any."""
    return next(
        (p for p in state.in_flight.values() if any(m.leaver == machine for m in p.moves)), None
    )


def plan_with_joiner(state: ClusterState, machine: str) -> Plan | None:
    """The in-flight plan in which `machine` joins, if any."""
    return next(
        (p for p in state.in_flight.values() if any(m.joiner == machine for m in p.moves)), None
    )


def replica(state: ClusterState, leaver: str, exclude: set[str]) -> str | None:
    """An active machine, not in `exclude` (the other leavers), holding the same state in
    another DP replica (the same pipeline stage and, when DP shards the state, the same
    shard)."""
    cell = state.machines[leaver].cell
    assert cell is not None
    for name, m in sorted(state.machines.items()):
        if (
            name != leaver
            and name not in exclude
            and m.status == "active"
            and m.cell is not None
            and state.layout.holds_same_state(cell, m.cell)
        ):
            return name
    return None


def role_holders(state: ClusterState) -> list[str]:
    """The machines that hold a role of the job (active, or leaving in a migration), by
    name: who takes part in a recovery."""
    return sorted(
        n
        for n, m in state.machines.items()
        if m.cell is not None and m.status in ("active", "leaving")
    )


def latest_generations(state: ClusterState) -> dict[str, int]:
    """Per group, the highest generation built or claimed: a new plan takes the next."""
    return {
        name: max(state.generations.get(name, 0), state.claimed_generations.get(name, 0))
        for name in state.layout.group_names()
    }


def cancel_plan(state: ClusterState, plan: Plan) -> ClusterState:
    """Drops a superseded plan; its groups' generations stay claimed (some ranks may have
    built them: a later incarnation must not reuse their store prefix)."""
    return claim_generations(drop_plan(state, plan, restore_joiner=False), plan)


def claim_generations(state: ClusterState, plan: Plan) -> ClusterState:
    """The generations of `plan`'s groups are never handed out again."""
    claimed = dict(state.claimed_generations)
    for spec in plan.groups:
        claimed[spec.name] = max(claimed.get(spec.name, 0), spec.generation)
    return state.model_copy(update={"claimed_generations": claimed})


def failures_of(plan: Plan) -> dict[str, str]:
    """A recovery's failure events -> the machine each reported (merged ones included)."""
    own = sorted(plan.leavers() - set(plan.merged_events.values())) or [plan.moves[0].leaver]
    return {**plan.merged_events, plan.event_id: own[0]}


def is_failure(queued: QueuedEvent) -> bool:
    """Whether a queued event is a failure waiting for a standby (else a drain)."""
    return isinstance(decode_event(queued.raw), FailureEvent)


def first_move(moves: dict[str, str]) -> tuple[str, str]:
    """The (leaver, joiner) a progress message names (its `moves` lists them all)."""
    return min(moves.items())


def note(
    state: ClusterState,
    event_id: str,
    status: str,
    detail: str,
    leaver: str | None,
    joiner: str | None = None,
    plan_id: str | None = None,
) -> MigrationProgress:
    """The progress message reporting `status` of event `event_id` (with the moves of
    `plan_id` when it is in flight)."""
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
