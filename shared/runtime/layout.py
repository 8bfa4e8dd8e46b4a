"""The parallel layout: roles, machines and the communication groups they form.

Pure (no torch import) so the planner can use it cheaply. A role is a rank's coordinates
(dp, pp, tp); a machine holds the TP ranks of one (dp, pp) cell; a group is named after
the coordinates it spans and lists its members in group-rank order. A joiner takes over
exactly the leaver's roles, so group ranks never change across a migration (which is what
keeps reductions, and therefore training, bit-identical).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: "world": the default group of a TP/PP layout, built lazily by each rank
#: (`trainmover.runtime.world`), never part of a plan.
GroupKind = Literal["tp", "pp", "dp", "transfer", "world"]

#: A machine role's warm-up class: its pipeline stage's position (what a standby warms).
RoleType = Literal["only", "first", "middle", "last"]

#: Group kinds a training role belongs to (one group of each kind).
ROLE_GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp")


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

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'2x2x2' -> Layout(tp=2, pp=2, dp=2) (TP x PP x DP); ValueError naming the text."""
        try:
            tp, pp, dp = (int(x) for x in text.lower().split("x"))
            return cls(tp=tp, pp=pp, dp=dp)
        except ValueError:
            raise ValueError(f"layout {text!r} is not TPxPPxDP (three positive integers)") from None

    @property
    def label(self) -> str:
        """'TPxPPxDP', as `parse` reads it."""
        return f"{self.tp}x{self.pp}x{self.dp}"

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
        if kind == "tp":
            return f"tp.d{role.dp}.p{role.pp}"
        if kind == "pp":
            return f"pp.d{role.dp}.t{role.tp}"
        if kind == "dp":
            return f"dp.p{role.pp}.t{role.tp}"
        raise ValueError(f"a role has no group of kind {kind!r}")

    def group_members(self, kind: GroupKind, role: Role) -> list[Role]:
        """Members of the `kind` group containing `role`, in group-rank order."""
        if kind == "tp":
            return [Role(dp=role.dp, pp=role.pp, tp=t) for t in range(self.tp)]
        if kind == "pp":
            return [Role(dp=role.dp, pp=p, tp=role.tp) for p in range(self.pp)]
        if kind == "dp":
            return [Role(dp=d, pp=role.pp, tp=role.tp) for d in range(self.dp)]
        raise ValueError(f"a role has no group of kind {kind!r}")

    def all_groups(self) -> dict[str, tuple[GroupKind, list[Role]]]:
        """Every group of the job: name -> (kind, members in group-rank order)."""
        groups: dict[str, tuple[GroupKind, list[Role]]] = {}
        for cell in self.cells():
            for role in self.roles_of(cell):
                for kind in ROLE_GROUP_KINDS:
                    groups.setdefault(
                        self.group_name(kind, role), (kind, self.group_members(kind, role))
                    )
        return dict(sorted(groups.items()))

    def groups_containing(self, roles: list[Role]) -> list[str]:
        """Names of the groups that contain any of `roles` (the delta of moving them)."""
        return sorted({self.group_name(k, r) for r in roles for k in ROLE_GROUP_KINDS})
