"""Migration plans and their delta: which groups a move rebuilds, with which members.

Pure (no torch import). A plan names, for each move, the leaver machine, the joiner
machine and the roles that pass from one to the other; the *delta* is every group that
contains one of those roles, each at its next generation, with the joiner's ranks in the
leaver's group ranks. Transfer pairs (leaver rank -> joiner rank) are one-off groups
whose store prefix is unique to the plan.

The same `GroupSpec` describes a job's initial groups (generation 0), so every group a
rank ever builds comes from the supervisor/planner, never from the rank's own guess.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from trainmover.runtime.layout import GroupKind, Layout, MachineRole, Role

PLAN_SCHEMA_VERSION = 1


class RankRef(BaseModel):
    """One worker process: a machine and a local rank on it."""

    model_config = ConfigDict(frozen=True)

    machine: str
    local_rank: int = Field(ge=0)

    def __str__(self) -> str:
        return f"{self.machine}/{self.local_rank}"


class GroupSpec(BaseModel):
    """One incarnation of a communication group."""

    model_config = ConfigDict(frozen=True)

    name: str
    kind: GroupKind
    generation: int = Field(ge=0)
    #: Members in group-rank order.
    members: list[RankRef]

    def store_prefix(self, job: str) -> str:
        """Rendezvous key prefix. Never reused: a new incarnation gets a new generation,
        and members reusing an old prefix would dial the old members' addresses."""
        return f"{job}/{self.name}/g{self.generation}/"

    def group_rank(self, me: RankRef) -> int | None:
        """My rank in this group, or None when I am not a member."""
        try:
            return self.members.index(me)
        except ValueError:
            return None


class Move(BaseModel):
    """One machine's roles passing from a leaver to a joiner (local rank i -> local rank i)."""

    model_config = ConfigDict(frozen=True)

    leaver: str
    joiner: str
    cell: MachineRole
    roles: list[Role]


class Plan(BaseModel):
    """A planned migration: what the executor sends to every affected rank."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = PLAN_SCHEMA_VERSION
    job: str
    plan_id: str
    moves: list[Move]
    #: The delta: new-generation groups (all groups when `full` was asked for).
    groups: list[GroupSpec]
    #: One pair per moved role: [leaver rank, joiner rank].
    transfers: list[GroupSpec]

    def leavers(self) -> set[str]:
        return {m.leaver for m in self.moves}

    def joiners(self) -> set[str]:
        return {m.joiner for m in self.moves}

    def affected_machines(self) -> set[str]:
        """Every machine that does work in this plan: leavers, joiners, delta stayers."""
        machines = self.leavers() | self.joiners()
        for spec in self.groups:
            machines |= {r.machine for r in spec.members}
        return machines

    def stayers(self) -> set[str]:
        return self.affected_machines() - self.leavers() - self.joiners()

    def move_of(self, machine: str) -> Move | None:
        """The move where `machine` is leaver or joiner."""
        return next((m for m in self.moves if machine in (m.leaver, m.joiner)), None)

    def specs_for(self, me: RankRef) -> list[GroupSpec]:
        """The groups (delta and transfer) `me` must build, in the global build order.

        Every rank builds its groups one after the other in the same total order (by
        name); like lock ordering, this rules out two ranks waiting on each other's
        rendezvous in opposite orders."""
        mine = [s for s in [*self.groups, *self.transfers] if s.group_rank(me) is not None]
        return sorted(mine, key=lambda s: s.name)


def rank_of(machine: str, role: Role) -> RankRef:
    """The worker process playing `role` on `machine` (local rank = tp)."""
    return RankRef(machine=machine, local_rank=role.tp)


def group_specs(
    layout: Layout,
    assignment: dict[str, MachineRole],
    generations: dict[str, int],
    names: list[str] | None = None,
) -> list[GroupSpec]:
    """Specs of the named groups (all when None) for a machine -> cell assignment."""
    machine_of = {cell: machine for machine, cell in assignment.items()}
    specs = []
    for name, (kind, members) in layout.all_groups().items():
        if names is not None and name not in names:
            continue
        refs = [rank_of(machine_of[MachineRole(dp=r.dp, pp=r.pp)], r) for r in members]
        specs.append(GroupSpec(name=name, kind=kind, generation=generations[name], members=refs))
    return specs


def compute_delta(
    *,
    job: str,
    plan_id: str,
    layout: Layout,
    assignment: dict[str, MachineRole],
    generations: dict[str, int],
    moves: dict[str, str],
    full: bool = False,
) -> Plan:
    """The plan that moves each leaver in `moves` (leaver -> joiner) to its joiner.

    `assignment` maps active machines to cells before the migration and `generations` is
    the current generation of every group. With `full`, every group of the job is rebuilt
    (the baseline the delta is compared against).
    """
    plan_moves: list[Move] = []
    after = dict(assignment)
    for leaver, joiner in sorted(moves.items()):
        if leaver not in assignment:
            raise ValueError(f"{leaver} is not an active machine")
        if joiner in assignment:
            raise ValueError(f"{joiner} is already active, not a standby")
        cell = assignment[leaver]
        plan_moves.append(
            Move(leaver=leaver, joiner=joiner, cell=cell, roles=layout.roles_of(cell))
        )
        del after[leaver]
        after[joiner] = cell
    if len(set(moves.values())) != len(moves):
        raise ValueError("two leavers cannot share one joiner")

    moved_roles = [r for m in plan_moves for r in m.roles]
    names = list(layout.all_groups()) if full else layout.groups_containing(moved_roles)
    next_gen = {n: generations[n] + 1 for n in names}
    groups = group_specs(layout, after, next_gen, names)
    transfers = [
        GroupSpec(
            name=f"transfer.{plan_id}.{role.key}",
            kind="transfer",
            generation=0,
            members=[rank_of(m.leaver, role), rank_of(m.joiner, role)],
        )
        for m in plan_moves
        for role in m.roles
    ]
    return Plan(job=job, plan_id=plan_id, moves=plan_moves, groups=groups, transfers=transfers)
