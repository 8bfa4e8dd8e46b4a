"""Which control requests a rank accepts: the plan-acceptance state machine, pure.

One rank's view of the protocol, as data: the planned migration it accepted (phase 1 or
committed), the recover plan it carries out, the recover plans it refuses from now on,
the last step boundary it passed, how far it may train, and whether it was stopped.
Requests come in (`prepare`, `commit`, `recover`, `advance`, `stop`) and a decision comes
out: accepted (what to do), an idempotent retry (answer as before), or refused (an
exception naming why; the control connection replies with it). The training thread asks
`at_boundary` and `join` what to do between two steps.

No torch, no threads, no I/O: the runtime holds its lock around every call and carries
out the decisions (`trainmover.runtime.switch`, `trainmover.runtime.recovery`), so every
rule below is unit-tested without processes (tests/runtime/test_acceptance.py).

The order of the rules follows the protocol: a rank takes a part in a plan (`part_in`,
the only place where leaver, joiner, source and stayer are told apart), accepts phase 1
(`prepare`), accepts the commit of a step it has not passed (`commit`), switches or
trains at each boundary (`at_boundary`, `join`), and a failure's recover plan overrides
whatever planned migration was in flight (`recover`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from trainmover.runtime.layout import GroupKind, Role
from trainmover.runtime.plan import GroupSpec, Plan, RankRef

Part = Literal["leaver", "joiner", "stayer"]
RecoveryPart = Literal["joiner", "source", "stayer"]
Action = Literal["recover", "wait", "switch", "finish", "train"]


def part_in(plan: Plan, machine: str, *, recovery: bool) -> Part | RecoveryPart:
    """`machine`'s part in `plan`: the joiner; in a planned migration the leaver, in a
    recovery (the leaver is dead) the state source; else a stayer."""
    if machine in plan.joiners():
        return "joiner"
    if not recovery and machine in plan.leavers():
        return "leaver"
    if recovery and machine in plan.sources():
        return "source"
    return "stayer"


def joiner_role(plan: Plan, me: RankRef) -> Role:
    """The role `me` (a joiner's rank) takes over from the leaver's rank of the same tp."""
    move = plan.move_of(me.machine)
    assert move is not None, f"{me.machine} has no move in {plan.plan_id}"
    return move.roles[me.local_rank]


class Build(Protocol):
    """What acceptance reads of a phase-1 build (a `GroupBuilder`), and how a replaced
    one is given up."""

    @property
    def done(self) -> bool: ...

    error: BaseException | None

    def discard(self) -> None: ...


@dataclass
class Planned:
    """The planned migration this rank accepted in phase 1."""

    plan: Plan
    part: Part
    build: Build
    commit_step: int | None = None
    steps_during_build: int = 0


@dataclass
class Recovering:
    """The recover plan this rank carries out at its next boundary."""

    plan: Plan
    part: RecoveryPart


@dataclass(frozen=True)
class PrepareDecision:
    """`prepare` accepted: build `specs` for `part`; `replaced` is the phase-1 migration
    this plan replaces (its build is discarded, never installed); `take` the role a
    joiner takes now. `retry`: the same plan again, answered as the first time."""

    part: Part
    specs: list[GroupSpec]
    take: Role | None = None
    replaced: Planned | None = None
    retry: bool = False


@dataclass(frozen=True)
class RecoverDecision:
    """`recover` accepted: this rank's `part`; `take` the role a standby joiner takes
    now; `discarded` the planned migration the failure caught (its build is never
    installed). `retry`: the same plan again."""

    part: RecoveryPart
    take: Role | None = None
    discarded: Planned | None = None
    retry: bool = False


@dataclass(frozen=True)
class CommitDecision:
    """`accepted`: this rank switches at k if every committer took it
    (`trainmover.runtime.switchvote`); `part` its part (None: an unknown plan);
    `retry`: the same k again, answered as before."""

    accepted: bool
    reason: str = ""
    part: Part | None = None
    retry: bool = False


@dataclass
class Acceptance:
    """One rank's accepted plans and step bounds (see the module docstring)."""

    me: RankRef
    #: Steps the job trains in all: a rank past the last one finishes.
    total_steps: int
    role: Role | None = None
    planned: Planned | None = None
    recovering: Recovering | None = None
    #: Recover plans a newer plan replaced: a late retry of one is refused.
    superseded: set[str] = field(default_factory=set)
    #: The last step whose boundary this rank has left (-1: none yet).
    passed: int = -1
    #: The supervisor lets this rank train up to this step.
    limit: int = 0
    stopped: bool = False

    # -- phase 1 -----------------------------------------------------------------------

    def prepare(self, plan: Plan, generations: Mapping[GroupKind, int]) -> PrepareDecision:
        """Phase 1 of `plan`. `generations` is the current generation of each of this
        rank's group kinds. Refused (RuntimeError) while another plan is in flight,
        unless that one is still in phase 1 and this one rebuilds some of its groups:
        the planner never has two plans rebuilding one group, so the older one ended in
        phase 1 (failed or withdrawn) and nobody will commit it. Refused (ValueError)
        when it would move a stayer's group back or not forward: a stale or replayed
        plan. Generations may be skipped (those of a plan that ended in phase 1 stay
        claimed: their store prefixes are never reused)."""
        old = self.planned
        if old is not None and old.plan.plan_id == plan.plan_id:
            return PrepareDecision(old.part, plan.specs_for(self.me), retry=True)
        replaced = None
        if old is not None:
            overlap = {g.name for g in old.plan.groups} & {g.name for g in plan.groups}
            if old.commit_step is not None or old.part == "joiner" or not overlap:
                raise RuntimeError(f"plan {old.plan.plan_id} still in flight")
            replaced = old
        part = part_in(plan, self.me.machine, recovery=False)
        assert part != "source"
        specs = plan.specs_for(self.me)
        if part == "stayer":
            for spec in specs:
                current = generations.get(spec.kind)
                if current is not None and spec.generation <= current:
                    raise ValueError(
                        f"{spec.name}: plan generation {spec.generation}, current {current}"
                    )
        take = None
        if part == "joiner":
            take = self.role = joiner_role(plan, self.me)
        self.planned = None
        return PrepareDecision(part, specs, take=take, replaced=replaced)

    def prepared(self, plan: Plan, part: Part, build: Build) -> Planned:
        """Records phase 1 of `plan` as accepted, its groups building in `build`."""
        self.planned = Planned(plan, part, build)
        return self.planned

    # -- phase 2 -----------------------------------------------------------------------

    def commit(self, plan_id: str, step: int) -> CommitDecision:
        """Phase 2: switch at the boundary after `step`, if every committer takes it.
        Refused for a plan not in phase 1 here, before its groups are built, or (leaver,
        stayer) at a step this rank has already passed; a joiner has no steps of its own
        to pass. A later k replaces one that was not switched at (its round was
        dropped)."""
        mig = self.planned
        if mig is None or mig.plan.plan_id != plan_id:
            return CommitDecision(False, "unknown plan")
        if mig.commit_step == step:
            return CommitDecision(True, part=mig.part, retry=True)
        if not mig.build.done or mig.build.error is not None:
            return CommitDecision(False, "not ready", part=mig.part)
        if mig.part != "joiner" and step <= self.passed:
            return CommitDecision(False, "too late", part=mig.part)
        mig.commit_step = step
        return CommitDecision(True, part=mig.part)

    def dropped(self, mig: Planned, step: int) -> None:
        """The switch at `step` was dropped (a committer refused it): `mig` waits for a
        later commit; a leaver or stayer trains on over its old groups."""
        if mig.commit_step == step:
            mig.commit_step = None

    def at_boundary(self, step: int, aborted: bool) -> Action:
        """What the training thread does at the boundary after `step`: a recovery first;
        nothing while the epoch is `aborted` (no step may start before a recover plan);
        the switch at the commit step; finish when stopped or at the last step; train the
        next step when the supervisor allows it (recorded as passed: a commit for this
        step is refused from now on), else wait."""
        mig = self.planned
        if self.recovering is not None:
            return "recover"
        if aborted and not self.stopped:
            return "wait"
        if mig is not None and mig.commit_step == step:
            return "switch"
        if self.stopped or step >= self.total_steps:
            return "finish"
        if step < self.limit:
            self.passed = step
            if mig is not None and not mig.build.done:
                mig.steps_during_build += 1
            return "train"
        return "wait"

    def join(self, mig: Planned) -> Literal["wait", "commit", "superseded", "stopped"]:
        """A joiner before its first step (`mig` the migration it joins): wait for the
        commit; a recovery that came first supersedes the migration (its leaver
        failed)."""
        if mig.commit_step is not None:
            return "commit"
        if self.recovering is not None:
            return "superseded"
        return "stopped" if self.stopped else "wait"

    def switched(self, mig: Planned) -> None:
        """`mig` has switched (or was given up): nothing planned is in flight."""
        if self.planned is mig:
            self.planned = None

    # -- failures ----------------------------------------------------------------------

    def recover(self, plan: Plan) -> RecoverDecision:
        """A failure's recover plan, carried out at the next boundary. Refused
        (ValueError) when a newer plan superseded it, for a joiner that already has
        another role, and for a standby the plan does not name; refused (RuntimeError)
        while another recovery that it does not supersede is in flight. A planned
        migration caught by the failure is superseded by it: its phase-1 groups are
        never installed."""
        part = part_in(plan, self.me.machine, recovery=True)
        assert part != "leaver"
        if plan.plan_id in self.superseded:
            raise ValueError(f"recover: plan {plan.plan_id} was superseded")
        if self.recovering is not None:
            if self.recovering.plan.plan_id == plan.plan_id:
                return RecoverDecision(part, retry=True)
            if self.recovering.plan.plan_id not in plan.supersedes:
                raise RuntimeError(f"recovery {self.recovering.plan.plan_id} still in flight")
        take = None
        if part == "joiner":
            role = joiner_role(plan, self.me)
            if self.role is None:
                take = self.role = role
            elif self.role != role:
                # The same role is fine: a joiner kept by the plan that superseded hers.
                raise ValueError("recover: the joiner already has another role")
        elif self.role is None:
            raise ValueError("recover: a standby that is not the plan's joiner")
        discarded, self.planned = self.planned, None
        self.superseded.update(plan.supersedes)
        self.recovering = Recovering(plan, part)
        return RecoverDecision(part, take=take, discarded=discarded)

    def recovered(self, rec: Recovering) -> None:
        """`rec` is carried out; a newer plan that arrived meanwhile stays for the next
        boundary."""
        if self.recovering is rec:
            self.recovering = None
