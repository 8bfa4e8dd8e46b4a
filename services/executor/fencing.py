"""Fencing, decided from the planner's cluster state: which machines must stop training.

A machine the planner declared failed may still be alive (a false alarm, a hang, an
alert for the wrong host): its workers must stop before, or while, its role trains on
another machine, and it may come back only as a fresh standby. The executor follows the
cluster state and sends `fence` to the sidecar of every machine that

- is a leaver of an in-flight recovery (unplanned or checkpoint restart): it is fenced
  as the recovery starts, beside the survivors' `recover`, not after it; or
- turned `failed` (a failed standby, or a leaver whose recovery just ended).

A fence names the instance (incarnation of the workers) the planner saw, when it knows
it, so a late or repeated fence never kills the fresh standby the machine became since.
A machine cut off while it was declared failed never hears the command; its sidecar
applies the same rule to itself when it reads the cluster state again (`fenced_in`).
The store refuses the fenced workers anyway: their commit votes belong to the aborted
epoch and their group claims to generations whose members they are not
(docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmover.messages import ClusterState


@dataclass(frozen=True)
class Fence:
    """One fence to send: `machine`'s workers of `instance` ("" where not known)."""

    machine: str
    instance: str

    @property
    def command_id(self) -> str:
        return f"fence.{self.machine}.{self.instance or 'unknown'}"


def recovering(state: ClusterState) -> set[str]:
    """Leavers of the in-flight recoveries: gone, or to be made gone."""
    return {
        move.leaver
        for plan in state.in_flight.values()
        if plan.migration != "planned"
        for move in plan.moves
    }


def to_fence(previous: ClusterState | None, state: ClusterState) -> list[Fence]:
    """The fences `state` calls for that `previous` (the state seen before it; None for
    the first one) did not. From a first state, only machines whose instance is known
    are fenced: an unknown one may be a fresh standby already."""
    before = recovering(previous) if previous is not None else set()
    out: list[Fence] = []
    for name, machine in sorted(state.machines.items()):
        was = previous.machines.get(name) if previous is not None else None
        newly_failed = machine.status == "failed" and (was is None or was.status != "failed")
        newly_recovered = name in recovering(state) and name not in before
        if not (newly_failed or newly_recovered):
            continue
        if previous is None and not machine.instance:
            continue
        out.append(Fence(name, machine.instance or ""))
    return out


def fenced_in(state: ClusterState, machine: str, instance: str) -> bool:
    """Whether `state` fences `machine`'s workers of `instance`: the machine is failed,
    or the leaver of an in-flight recovery, and the planner saw this very instance."""
    mine = state.machines.get(machine)
    if mine is None or mine.instance != instance:
        return False
    return mine.status == "failed" or machine in recovering(state)
