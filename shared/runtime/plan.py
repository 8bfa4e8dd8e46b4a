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

from typing import Literal

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
    #: Set when a recovery rebuilds a group outside the delta whose old incarnation is
    #: dirty (an abandoned work): same members and generation, a prefix of its own.
    repair: str = ""

    def store_prefix(self, job: str) -> str:
        """Rendezvous key prefix. Never reused: a new incarnation gets a new generation
        (or a repair tag), and members reusing an old prefix would dial the old members'
        addresses."""
        base = f"{job}/{self.name}/g{self.generation}/"
        return f"{base}r-{self.repair}/" if self.repair else base

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
    #: The machine the joiner's state comes from: None for the leaver itself (planned),
    #: a data-parallel replica of the cell (unplanned); unused for a checkpoint restore.
    source: str | None = None

    @property
    def state_source(self) -> str:
        return self.source or self.leaver


class Plan(BaseModel):
    """A planned migration: what the executor sends to every affected rank."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = PLAN_SCHEMA_VERSION
    job: str
    plan_id: str
    moves: list[Move]
    #: The delta: new-generation groups (all groups when `full` was asked for).
    groups: list[GroupSpec]
    #: One pair per moved role: [state source rank, joiner rank].
    transfers: list[GroupSpec]
    #: Where joiners get state: over the transfer pairs, or (no replica, DP=1) every rank
    #: of the job reloads the last checkpoint common to all roles.
    restore: Literal["transfer", "checkpoint"] = "transfer"
    #: Recovery plans this one replaces (a failure during a recovery): a rank still in
    #: one of them abandons it for this plan and refuses it from then on.
    supersedes: list[str] = Field(default_factory=list)

    def joiner_sources(self) -> dict[str, str]:
        """leaver -> the machine its joiner's state comes from (the leaver itself, or a
        data-parallel replica when unplanned); empty for a checkpoint restore."""
        if self.restore != "transfer":
            return {}
        return {m.leaver: m.state_source for m in self.moves}

    def sources(self) -> set[str]:
        """Machines that send state to a joiner (leavers, or replicas when unplanned)."""
        return set(self.joiner_sources().values())

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

    def committers(self) -> list[RankRef]:
        """The ranks whose acceptance of commit(k) the switch at k needs: every member of
        the delta and of the transfer pairs but the joiners' ranks (a joiner has no steps
        of its own to pass)."""
        joiners = self.joiners()
        ranks = {r for s in [*self.groups, *self.transfers] for r in s.members}
        return sorted(
            (r for r in ranks if r.machine not in joiners), key=lambda r: (r.machine, r.local_rank)
        )

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
    # By (dp, pp), not MachineRole: a delta's data-parallel groups have a member per
    # replica (thousands in a large job), and a model per lookup doubled a plan's time.
    machine_of = {(cell.dp, cell.pp): machine for machine, cell in assignment.items()}
    specs = []
    for name in layout.group_names() if names is None else sorted(set(names)):
        if not layout.has_group(name):
            continue
        kind, members = layout.group(name)
        refs = [rank_of(machine_of[(r.dp, r.pp)], r) for r in members]
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
    sources: dict[str, str] | None = None,
    restore: Literal["transfer", "checkpoint"] = "transfer",
    supersedes: list[str] | None = None,
) -> Plan:
    """The plan that moves each leaver in `moves` (leaver -> joiner) to its joiner.

    `assignment` maps active machines to cells before the migration and `generations` is
    the current generation of every group. With `full`, every group of the job is rebuilt
    (the baseline the delta is compared against). `sources` (leaver -> machine) names
    where each joiner's state comes from when not from the leaver: a data-parallel
    replica of the leaver's cell (unplanned; the pair is then [replica rank, joiner
    rank]). With `restore="checkpoint"` there are no transfer pairs: every rank reloads
    the last common checkpoint. `supersedes` names the plans this one replaces.
    """
    sources = sources or {}
    plan_moves: list[Move] = []
    after = dict(assignment)
    for leaver, joiner in sorted(moves.items()):
        if leaver not in assignment:
            raise ValueError(f"{leaver} is not an active machine")
        if joiner in assignment:
            raise ValueError(f"{joiner} is already active, not a standby")
        cell = assignment[leaver]
        source = sources.get(leaver)
        if source is not None and source != leaver:
            other = assignment.get(source)
            if other is None or not layout.holds_same_state(cell, other):
                raise ValueError(f"{source} is not a data-parallel replica of {leaver}")
        plan_moves.append(
            Move(
                leaver=leaver,
                joiner=joiner,
                cell=cell,
                roles=layout.roles_of(cell),
                source=None if source in (None, leaver) else source,
            )
        )
        del after[leaver]
        after[joiner] = cell
    if len(set(moves.values())) != len(moves):
        raise ValueError("two leavers cannot share one joiner")

    moved_roles = [r for m in plan_moves for r in m.roles]
    names = layout.group_names() if full else layout.groups_containing(moved_roles)
    next_gen = {n: generations[n] + 1 for n in names}
    groups = group_specs(layout, after, next_gen, names)
    transfers = [
        GroupSpec(
            name=f"transfer.{plan_id}.{role.key}",
            kind="transfer",
            generation=0,
            # The source's rank of the same tp (local rank = tp on every machine).
            members=[rank_of(m.state_source, role), rank_of(m.joiner, role)],
        )
        for m in plan_moves
        for role in m.roles
        if restore == "transfer"
    ]
    return Plan(
        job=job,
        plan_id=plan_id,
        moves=plan_moves,
        groups=groups,
        transfers=transfers,
        restore=restore,
        supersedes=supersedes or [],
    )
