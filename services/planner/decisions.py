"""The planner's decisions, as pure functions of (cluster state, input) -> new state + outputs.

No bus, no clock of its own, no I/O: the service feeds events, progress and heartbeats in
and publishes what comes out, so every rule here is unit-tested without processes.
`Planner` is the entry point; the rules live in the modules beside it: `drain` (planned
migrations), `recovery` (failures), `pool` (standby admission), `plans` (building a
plan), `cluster` (reads and edits of the ClusterState).

Rules (terms: docs/glossary.md):
- drain: planned migration to a free standby warm for the leaver's role type; queued
  when none is free (and planned as soon as one is).
- failure: unplanned migration with state from a data-parallel replica; with no replica
  (DP=1) or no free standby, a checkpoint restart, and the outcome says which.
- straggler: planned migration if a standby is free and the machine is out of its
  cool-down; otherwise ignored (it is only slow).
- a drain or rebalance whose migration failed before its switch (the executor says
  `retrying`; its leaver trains on) is queued first again, up to PLANNED_RETRIES times.
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

from trainmover.messages import (
    ClusterState,
    FailureEvent,
    Heartbeat,
    MigrationProgress,
    StragglerEvent,
    decode_event,
)
from trainmover.services.planner.cluster import (
    claim_generations,
    drop_plan,
    is_failure,
    rebuilding,
    remember,
    set_machine,
)
from trainmover.services.planner.drain import plan_planned, retry_planned
from trainmover.services.planner.plans import Event, Outcome, free_standby, pick_joiners, reject
from trainmover.services.planner.pool import admit
from trainmover.services.planner.recovery import on_failure, recover

__all__ = ["Event", "Outcome", "Planner"]


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
        """Decides a drain, failure, straggler or rebalance event (see the module docstring)."""
        if event.event_id in state.handled:
            return Outcome(state)  # a redelivery or a retried publish: already decided
        state = remember(state, event.event_id, "seen")
        if event.machine is None:
            # The service names the slowest machine before deciding; without step
            # statistics there is nothing to choose from.
            return reject(state, event, "no machine named and no step statistics yet")
        current = state.machines.get(event.machine)
        if current is None:
            return reject(state, event, f"unknown machine {event.machine!r}")
        if isinstance(event, FailureEvent):
            return on_failure(state, event, current, now)
        if current.status == "standby":
            # A standby holds no role; taking it out of the pool is its sidecar's stop,
            # not a migration (a drain that only marked it would be undone by its next
            # heartbeat).
            return reject(
                state,
                event,
                f"{event.machine} is a standby: nothing to drain (stop its sidecar to take "
                "it out of the pool)",
            )
        if current.status != "active":
            return reject(state, event, f"{event.machine} is already {current.status}")
        if any(q.machine == event.machine for q in state.queued):
            return reject(state, event, f"{event.machine} is already queued to leave")
        if isinstance(event, StragglerEvent):
            until = state.cooldown_until.get(event.machine, 0.0)
            if now < until:
                return reject(
                    state, event, f"{event.machine} moved recently (cool-down until {until:.0f})"
                )
        return plan_planned(state, event, now)

    # --- progress from the executor -----------------------------------------------------

    def on_progress(self, state: ClusterState, progress: MigrationProgress, now: float) -> Outcome:
        """Applies the end of a migration to the state. A planned migration ends for the
        job at `releasing`: every rank has switched, and what is left (the leaver's
        workers exiting) cannot undo it, so a leaver dying then is not a failure of the
        migration. Other non-terminal progress is ignored."""
        plan = state.in_flight.get(progress.plan_id or "")
        ended = ("done", "releasing", "failed", "aborted", "retrying")
        if plan is None or progress.state not in ended:
            return Outcome(state)
        if progress.state in ("done", "releasing"):
            state = drop_plan(state, plan, restore_joiner=False)
            generations = dict(state.generations)
            for spec in plan.groups:
                generations[spec.name] = spec.generation
            state = state.model_copy(update={"generations": generations})
            for move in plan.moves:
                leaver = state.machines[move.leaver]
                after = "failed" if plan.migration != "planned" else "maintenance"
                state = set_machine(
                    state, move.joiner, status="active", cell=move.cell, warm_role_types=[]
                )
                if leaver.status == "leaving":
                    state = set_machine(
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
            return serve_queue(Outcome(state), now)
        # Failed or aborted: the executor rolled phase 1 back; the leaver keeps its role
        # (planned) and the joiner goes back to the pool.
        # Its ranks may have built (or claimed) its groups: their generations stay claimed.
        # Its joiner may hold the role already: the executor has its sidecar relaunch it,
        # through maintenance, and it returns to the pool once warm.
        state = claim_generations(drop_plan(state, plan, restore_joiner=False), plan)
        for move in plan.moves:
            if state.machines[move.leaver].status == "leaving":
                state = set_machine(state, move.leaver, status="active")
            if state.machines[move.joiner].status == "joining":
                state = set_machine(state, move.joiner, status="maintenance", warm_role_types=[])
        if progress.state == "retrying":
            return serve_queue(retry_planned(state, plan, progress), now)
        return serve_queue(Outcome(state), now)

    # --- standby pool ------------------------------------------------------------------

    def on_heartbeat(self, state: ClusterState, beat: Heartbeat, now: float) -> Outcome:
        """Admits a warm, healthy machine to the standby pool (`pool.admit`); then serves
        queued drains."""
        admission = admit(state, beat, set(state.layout.role_types()), self.members)
        if admission.machine is None:
            return Outcome(state, refused=admission.reason)
        machines = {**state.machines, beat.machine: admission.machine}
        outcome = Outcome(state.model_copy(update={"machines": machines}), progress=[])
        return serve_queue(outcome, now)


def serve_queue(outcome: Outcome, now: float) -> Outcome:
    """Plans queued events, oldest first, while standbys (and their groups) are free:
    every failure waiting is recovered at once, a drain runs alone."""
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
                q.machine: None for q in state.queued if is_failure(q)
            }
            if pick_joiners(state, waiting) is None:
                break
            planned = recover(state, [], now)
        else:
            if free_standby(state, head.machine) is None or rebuilding(state, head.machine):
                break
            state = state.model_copy(update={"queued": rest})
            planned = plan_planned(state, event, now, head.retries_left)
        state = planned.state
        outcome.plans += planned.plans
        outcome.progress += planned.progress
    outcome.state = state
    return outcome
