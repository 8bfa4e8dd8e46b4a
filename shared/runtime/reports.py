"""What a driven migration or failure recovery reported (`trainmover.localjob.LocalJob`'s
`migrate` and `recover`): the plan, the wall-clock marks of its phases and each rank's
answers."""

from __future__ import annotations

from dataclasses import dataclass

from trainmover.runtime import control as c
from trainmover.runtime.plan import Plan, RankRef


@dataclass
class MigrationReport:
    """What one migration did, as the workers reported it."""

    plan: Plan
    commit_step: int
    prepare_sent: float
    ready: dict[RankRef, c.Ready]
    ready_at: float
    commit_sent: float
    commit_acked: float
    switched: dict[RankRef, c.Switched]


@dataclass
class RecoveryReport:
    """What one recovery from a machine failure did."""

    plan: Plan
    dead: str
    #: Wall clock: the harness noticed the death; the recovery began.
    detected_at: float
    recover_sent: float
    switched: dict[RankRef, c.Switched]

    @property
    def step(self) -> int:
        """The step every rank resumed from (they all agree, or this raises)."""
        steps = {e.step for e in self.switched.values()}
        if len(steps) != 1:
            raise AssertionError(f"ranks resumed from different steps: {steps}")
        return steps.pop()
