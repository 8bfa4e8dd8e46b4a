"""Admission to the standby pool, pure: which heartbeat may put a machine in the job.

A machine is in the job because the planner admitted it, never because a message named
it. The rules, each a reason a heartbeat is turned away:

- the machine must be one the job config names (its machines and standbys): a
  heartbeat for any other name never adds a machine to the cluster state;
- only a warm standby with healthy workers is admitted, and only when the planner has
  no role for it (unknown yet, back from maintenance, or failed);
- a machine the planner released (maintenance) or declared failed comes back only as a
  *fresh* incarnation: its heartbeat must name another `instance` than the one the
  planner saw holding the role. A sidecar starts a new instance only after its old
  workers are gone (it fenced them, it was restarted, or the machine rebooted), so a
  standby heartbeat of the fenced workers, or a replay of one, is not believed.

`admit` returns the new machine state or None (nothing to change), with the reason it
turned the heartbeat away for the log.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmover.messages import ClusterState, Heartbeat, MachineState

RETURNING = ("maintenance", "failed")
"""Statuses a machine leaves only by being admitted again as a standby."""


@dataclass(frozen=True)
class Admission:
    """What a heartbeat does to its machine: `machine` is the new state (None: none)."""

    machine: MachineState | None
    reason: str = ""


def admit(
    state: ClusterState,
    beat: Heartbeat,
    wanted_types: set[str],
    members: frozenset[str] | None,
) -> Admission:
    """The pool rules above for one heartbeat (`members`: the names the job config allows,
    None for any)."""
    if members is not None and beat.machine not in members:
        return Admission(None, f"{beat.machine!r} is not a machine of job {state.job!r}")
    current = state.machines.get(beat.machine)
    if (
        beat.status == "active"
        and current is not None
        and current.status == "active"
        and current.instance is None
        and beat.instance
    ):
        # The incarnation that holds the role: remembered so that it cannot come back.
        return Admission(current.model_copy(update={"instance": beat.instance}))
    if beat.status != "standby":
        return Admission(None)
    warm = sorted(t for t in beat.warm_role_types if t in wanted_types)
    if current is not None and current.status == "standby":
        instance = beat.instance or current.instance
        if (warm, instance) == (current.warm_role_types, current.instance):
            return Admission(None)
        return Admission(current.model_copy(update={"warm_role_types": warm, "instance": instance}))
    if current is not None and current.status not in RETURNING:
        return Admission(None, f"{beat.machine} is {current.status}: not a standby")
    if any(w.state == "exited" for w in beat.workers):
        return Admission(None, "a worker has exited")
    if not warm:
        return Admission(None, "not warm for any role type of the job")
    if current is not None and current.instance and beat.instance == current.instance:
        return Admission(
            None,
            f"{beat.machine} is {current.status} and still runs the same workers "
            f"(instance {beat.instance[:8]}): it returns only as a fresh standby",
        )
    return Admission(
        MachineState(status="standby", warm_role_types=warm, instance=beat.instance or None)
    )
