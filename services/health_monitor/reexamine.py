"""Asking the planner again about a straggler it turned down, pure.

The detector flags a machine once per slow spell (hysteresis), so that one event is the
only question the planner ever gets about it. The planner turns a straggler down when it
cannot act at that moment: no warm standby free, another migration rebuilding the
machine's groups, or the machine moved recently (its cool-down). The verdict may stand
long after the obstacle is gone. `reason_to_ask_again` says when to ask once more:

- the planner decided the machine's last straggler event, and it said "rejected"
  (an event not yet decided, or one that became a plan, is never asked again);
- the cluster state could now say yes: the machine is active, no migration is in flight,
  its cool-down is over, and a standby warm for its role type is free;
- the last question is at least `min_interval_s` old, so a planner that keeps saying no
  for a reason this rule does not model is not asked in a loop.

The caller checks that the detector still flags the machine (the verdict persists).
"""

from __future__ import annotations

from trainmover.messages import ClusterState
from trainmover.services.health_monitor.dedup import Incident
from trainmover.services.planner.plans import free_standby

REJECTED = "rejected"
"""The planner's record, in `ClusterState.handled`, of an event it turned down."""


def reason_to_ask_again(
    state: ClusterState,
    machine: str,
    last: Incident | None,
    now: float,
    min_interval_s: float,
) -> str | None:
    """Why the planner should get a new straggler event for `machine` now, or None.

    `last` is the machine's open straggler incident (None when there is none, e.g. it
    aged out of the dedup window); `now` is wall time, as the planner's cool-downs are.
    """
    if last is not None:
        if state.handled.get(last.event_id) != REJECTED:
            return None  # not decided yet, or planned: the planner is on it
        if now - last.opened_ts < min_interval_s:
            return None
    current = state.machines.get(machine)
    if current is None or current.status != "active" or state.in_flight:
        return None
    if now < state.cooldown_until.get(machine, 0.0):
        return None
    joiner = free_standby(state, machine)
    if joiner is None:
        return None
    what = f"event {last.event_id} was rejected" if last is not None else "no open incident"
    return f"still slow, {what}, and standby {joiner} is free now"
