"""The parallel layout: roles, machines and the communication groups they form.

Pure (no torch import) so the planner can use it cheaply. A role is a rank's coordinates
(dp, pp, tp); a machine holds the TP ranks of one (dp, pp) cell; a group is named after
the coordinates it spans and lists its members in group-rank order. A joiner takes over
exactly the leaver's roles, so group ranks never change across a migration (which is what
keeps reductions, and therefore training, bit-identical).

Data parallelism may shard state (FSDP2): `dp_shard` consecutive DP indices shard one
copy of the state between them, and `dp / dp_shard` such copies replicate it (HSDP; a DP
index d is shard d % dp_shard of replica d // dp_shard). Only ranks of the same shard
hold the same state, so only they are each other's replicas in a failure. When the DP
ranks are both sharded and replicated, a role has a group for each of the two
dimensions instead of one DP group.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: "world": the default group of a TP/PP layout, built lazily by each rank
#: (`trainmover.runtime.world`), never part of a plan.
GroupKind = Literal["tp", "pp", "dp", "dp_shard", "dp_replicate", "transfer", "world"]

#: A machine role's warm-up class: its pipeline stage's position (what a standby warms).
RoleType = Literal["only", "first", "middle", "last"]

#: Group kinds a training role belongs to, one group of each (`Layout.role_group_kinds`):
#: these, with "dp" split in two when the DP ranks are both sharded and replicated.
ROLE_GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp")
HSDP_GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp_shard", "dp_replicate")
#: The first part of a group's name (`Layout.group_name`) -> its kind.
GROUP_PREFIXES: dict[str, GroupKind] = {
    "tp": "tp", "pp": "pp", "dp": "dp", "dps": "dp_shard", "dpr": "dp_replicate",
}  # fmt: skip

#: A `DeviceMesh`'s dimensions, outermost first (torchtitan's order).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class Role(BaseModel):
    """A rank's coordinates in the TP x PP x DP layout."""

    model_config = ConfigDict(frozen=True)

    dp: int = Field(ge=0)
    pp: int = Field(ge=0)
    tp: int = Field(ge=0)

    @property
    def key(self) -> str:
        """Stable short name, used in file names and logs (e.g. ``d0p1t0``)."""
        return f"d{self.dp}p{self.pp}t{self.tp}"


class MachineRole(BaseModel):
    """The (dp, pp) cell a machine serves; its local rank i plays tp = i."""

    model_config = ConfigDict(frozen=True)

    dp: int = Field(ge=0)
    pp: int = Field(ge=0)


class Layout(BaseModel):
    """TP inside a machine, PP across machines of one replica, DP across replicas."""

    model_config = ConfigDict(frozen=True)

    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    #: DP ranks that shard one copy of the state (FSDP2); 1: every DP rank holds it all.
    dp_shard: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check_dp_shard(self) -> Layout:
        if self.dp % self.dp_shard:
            raise ValueError(f"layout.dp_shard={self.dp_shard} does not divide dp={self.dp}")
        return self

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'2x2x2' -> Layout(tp=2, pp=2, dp=2) (TP x PP x DP); '1x1x4s2' shards the state
        over 2 of the 4 DP ranks (dp_shard=2). ValueError naming the text."""
        try:
            sizes, _, shard = text.lower().partition("s")
            tp, pp, dp = (int(x) for x in sizes.split("x"))
            return cls(tp=tp, pp=pp, dp=dp, dp_shard=int(shard or 1))
        except ValueError:
            raise ValueError(
                f"layout {text!r} is not TPxPPxDP or TPxPPxDPsS (positive integers; S divides DP)"
            ) from None

    @property
    def label(self) -> str:
        """'TPxPPxDP' (with 'sS' when the state is sharded), as `parse` reads it."""
        shard = f"s{self.dp_shard}" if self.dp_shard > 1 else ""
        return f"{self.tp}x{self.pp}x{self.dp}{shard}"

    @property
    def dp_replicate(self) -> int:
        """Copies of the state across the DP ranks (HSDP's replicate dimension)."""
        return self.dp // self.dp_shard

    @property
    def hsdp(self) -> bool:
        """DP ranks both shard and replicate: a role has dp_shard and dp_replicate groups."""
        return 1 < self.dp_shard < self.dp

    @property
    def role_group_kinds(self) -> tuple[GroupKind, ...]:
        """The kinds of group a role belongs to, one group of each."""
        return HSDP_GROUP_KINDS if self.hsdp else ROLE_GROUP_KINDS

    def mesh_dims(self) -> dict[str, tuple[int, GroupKind]]:
        """A `DeviceMesh`'s dimensions (size > 1 only, in `MESH_DIMS` order), each with
        the kind of the role's group it runs over."""
        if self.hsdp:
            dp_dims: dict[str, tuple[int, GroupKind]] = {
                "dp_replicate": (self.dp_replicate, "dp_replicate"),
                "dp_shard": (self.dp_shard, "dp_shard"),
            }
        elif self.dp_shard > 1:
            dp_dims = {"dp_shard": (self.dp, "dp")}
        else:
            dp_dims = {"dp_replicate": (self.dp, "dp")}
        dims = {"pp": (self.pp, "pp"), **dp_dims, "tp": (self.tp, "tp")}
        return {d: dims[d] for d in MESH_DIMS if d in dims and dims[d][0] > 1}

    def mesh_coordinate(self, role: Role, dim: str) -> int:
        """`role`'s index along mesh dimension `dim`."""
        if dim == "dp_shard":
            return role.dp % self.dp_shard
        if dim == "dp_replicate":
            return role.dp // self.dp_shard
        return int(getattr(role, dim))

    def holds_same_state(self, a: MachineRole, b: MachineRole) -> bool:
        """Whether cell `b` is a data-parallel replica of cell `a` (another DP index of
        the same stage and shard): where a failed `a`'s state can come from."""
        return a.pp == b.pp and a.dp != b.dp and a.dp % self.dp_shard == b.dp % self.dp_shard

    @property
    def machines(self) -> int:
        return self.pp * self.dp

    @property
    def ranks_per_machine(self) -> int:
        return self.tp

    @property
    def world_size(self) -> int:
        """Ranks in the job (the default group's size)."""
        return self.machines * self.tp

    def cells(self) -> list[MachineRole]:
        """Every machine role, in the order machines are numbered (dp-major)."""
        return [MachineRole(dp=d, pp=p) for d in range(self.dp) for p in range(self.pp)]

    def roles_of(self, cell: MachineRole) -> list[Role]:
        """The roles of a machine, indexed by local rank."""
        return [Role(dp=cell.dp, pp=cell.pp, tp=t) for t in range(self.tp)]

    def role_type(self, pp: int) -> RoleType:
        """The warm-up class of pipeline stage `pp` (the planner uses the same names)."""
        if self.pp == 1:
            return "only"
        if pp == 0:
            return "first"
        return "last" if pp == self.pp - 1 else "middle"

    def role_types(self) -> list[RoleType]:
        """Every distinct role type of the layout, in pipeline order."""
        return list(dict.fromkeys(self.role_type(p) for p in range(self.pp)))

    def role_of_type(self, role_type: str, tp: int) -> Role:
        """A representative role of `role_type` (replica 0, the first such stage): what a
        standby builds to warm up for every role of that type."""
        for p in range(self.pp):
            if self.role_type(p) == role_type:
                return Role(dp=0, pp=p, tp=tp)
        raise ValueError(f"no role of type {role_type!r} in {self}")

    def global_rank(self, role: Role) -> int:
        """A conventional flat rank, for logs only (groups never use it)."""
        return (role.dp * self.pp + role.pp) * self.tp + role.tp

    def group_name(self, kind: GroupKind, role: Role) -> str:
        """Name of the group of `kind` that contains `role`."""
        return self._group_name(kind, role.dp, role.pp, role.tp)

    def _group_name(self, kind: GroupKind, dp: int, pp: int, tp: int) -> str:
        if kind == "tp":
            return f"tp.d{dp}.p{pp}"
        if kind == "pp":
            return f"pp.d{dp}.t{tp}"
        if kind == "dp":
            return f"dp.p{pp}.t{tp}"
        if kind == "dp_shard":
            return f"dps.r{dp // self.dp_shard}.p{pp}.t{tp}"
        if kind == "dp_replicate":
            return f"dpr.s{dp % self.dp_shard}.p{pp}.t{tp}"
        raise ValueError(f"a role has no group of kind {kind!r}")

    def group_members(self, kind: GroupKind, role: Role) -> list[Role]:
        """Members of the `kind` group containing `role`, in group-rank order."""
        if kind == "tp":
            return [Role(dp=role.dp, pp=role.pp, tp=t) for t in range(self.tp)]
        if kind == "pp":
            return [Role(dp=role.dp, pp=p, tp=role.tp) for p in range(self.pp)]
        if kind == "dp":
            return [Role(dp=d, pp=role.pp, tp=role.tp) for d in range(self.dp)]
        if kind == "dp_shard":
            first = role.dp - role.dp % self.dp_shard
            return [Role(dp=first + s, pp=role.pp, tp=role.tp) for s in range(self.dp_shard)]
        if kind == "dp_replicate":
            shard = role.dp % self.dp_shard
            return [
                Role(dp=r * self.dp_shard + shard, pp=role.pp, tp=role.tp)
                for r in range(self.dp_replicate)
            ]
        raise ValueError(f"a role has no group of kind {kind!r}")

    def rank_and_size(self, kind: GroupKind, role: Role) -> tuple[int, int]:
        """`role`'s rank in its group of `kind`, and the group's size (the world group:
        its global rank among every rank of the job)."""
        if kind == "world":
            return self.global_rank(role), self.world_size
        members = self.group_members(kind, role)
        return members.index(role), len(members)

    def _group_coordinates(self) -> list[tuple[GroupKind, int, int, int]]:
        """(kind, dp, pp, tp) of one member of each group of the job: O(groups), where
        asking every rank for its groups is O(ranks x kinds) (and building each group's
        members from each of its ranks, as `all_groups` once did, O(ranks x group size):
        seconds for one plan of a 2,048-machine job)."""
        pt = [(p, t) for p in range(self.pp) for t in range(self.tp)]
        out: list[tuple[GroupKind, int, int, int]] = []
        for kind in self.role_group_kinds:
            if kind == "tp":
                out += [(kind, d, p, 0) for d in range(self.dp) for p in range(self.pp)]
            elif kind == "pp":
                out += [(kind, d, 0, t) for d in range(self.dp) for t in range(self.tp)]
            elif kind == "dp":
                out += [(kind, 0, p, t) for p, t in pt]
            elif kind == "dp_shard":
                firsts = [r * self.dp_shard for r in range(self.dp_replicate)]
                out += [(kind, d, p, t) for d in firsts for p, t in pt]
            else:
                out += [(kind, d, p, t) for d in range(self.dp_shard) for p, t in pt]
        return out

    def group_names(self) -> list[str]:
        """Every group's name, sorted."""
        return sorted(self._group_name(*c) for c in self._group_coordinates())

    def group(self, name: str) -> tuple[GroupKind, list[Role]]:
        """The kind and members (in group-rank order) of the group called `name`;
        KeyError when the job has no such group."""
        prefix, *parts = name.split(".")
        kind = GROUP_PREFIXES.get(prefix)
        try:
            index = {part[0]: int(part[1:]) for part in parts}
        except (ValueError, IndexError):
            raise KeyError(name) from None
        if kind is None or kind not in self.role_group_kinds:
            raise KeyError(name)
        dp = index.get("d", index.get("s", index.get("r", 0) * self.dp_shard))
        rep = Role.model_construct(dp=dp, pp=index.get("p", 0), tp=index.get("t", 0))
        if not (0 <= rep.dp < self.dp and 0 <= rep.pp < self.pp and 0 <= rep.tp < self.tp):
            raise KeyError(name)
        if self.group_name(kind, rep) != name:
            raise KeyError(name)
        return kind, self.group_members(kind, rep)

    def has_group(self, name: str) -> bool:
        try:
            self.group(name)
        except KeyError:
            return False
        return True

    def all_groups(self) -> dict[str, tuple[GroupKind, list[Role]]]:
        """Every group of the job: name -> (kind, members in group-rank order)."""
        groups = {}
        for kind, dp, pp, tp in self._group_coordinates():
            groups[self._group_name(kind, dp, pp, tp)] = (
                kind,
                self.group_members(kind, Role(dp=dp, pp=pp, tp=tp)),
            )
        return dict(sorted(groups.items()))

    def groups_containing(self, roles: list[Role]) -> list[str]:
        """Names of the groups that contain any of `roles` (the delta of moving them)."""
        return sorted({self.group_name(k, r) for r in roles for k in self.role_group_kinds})
