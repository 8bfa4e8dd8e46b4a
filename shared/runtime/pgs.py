"""A rank's c10d process groups, the default group, and torch.distributed's entry points.

`ProcessGroups` gives a training loop one stable `SwappableGroup` per group kind of its
role (tp, pp, dp), forwarding to whatever runtime `Group` of that kind is current: the
live table's, or, while a joiner has not switched in yet, a sandboxed stand-in whose
collectives are answered locally (so a DDP built before the switch runs its start-up
collectives inside the sandbox). A standby's shadow iterations get a `ProcessGroups` of
their own over the sandbox's groups.

The default group: libraries and torchrun scripts call `dist.init_process_group()`,
`get_rank()` and `DDP(model)` without a group. The runtime patches
`torch.distributed.init_process_group` so that it installs the active `ProcessGroups`'s
default group instead of building one: in a data-parallel-only layout that is the DP
group itself (same members, same ranks), swapped like any other group. In a layout with
TP or PP it is a stable group over every rank of the job that answers rank and size at
once (what DeviceMesh and PipelineStage ask it) and forwards its collectives to the
runtime's group of kind "world": on a live rank a real group over every rank, built at
the first collective after each switch, never eagerly (a world group contains the leaver
of every migration; `trainmover.runtime.world`); inside the sandbox one answered locally.

`dist.new_group` is refused the same way: a group the runtime did not build is one a
migration cannot replace.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh_module
import torch.distributed.distributed_c10d as c10d_world
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from trainmover.runtime.c10d import SwappableGroup, UnsupportedCollective, register, unregister
from trainmover.runtime.groups import Group
from trainmover.runtime.layout import Layout, Role

#: Environment a torchrun script reads (set by the launcher and, once the role is known,
#: by the runtime).
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class LayoutMismatch(ValueError):
    """The script asked for a world or group shape the job config does not have."""


class ProcessGroups:
    """The c10d groups of one role: one per kind, plus the default group."""

    def __init__(
        self,
        layout: Layout,
        role: Role,
        current: Callable[[str], Group | None],
        store: dist.Store,
        prefix: str = "",
    ):
        self.layout, self.role = layout, role
        self._current = current
        self._store = store
        self._prefix = prefix
        self._groups: dict[str, SwappableGroup] = {}
        self._world: SwappableGroup | None = None
        self._mesh: DeviceMesh | None = None
        self._lock = threading.Lock()

    @property
    def dp_only(self) -> bool:
        """One DP group spans every rank: it is the default group."""
        return self.layout.tp == 1 and self.layout.pp == 1 and not self.layout.hsdp

    def get(self, kind: str) -> SwappableGroup:
        """The stable c10d group of `kind` ("tp", "pp" or "dp") for this role."""
        kinds = self.layout.role_group_kinds
        if kind not in kinds:
            raise ValueError(
                f"no process group of kind {kind!r} in layout {self.layout.label}: one of "
                f"{kinds}" + (" (its DP ranks shard and replicate)" if self.layout.hsdp else "")
            )
        with self._lock:
            pg = self._groups.get(kind)
            if pg is None:
                members = self.layout.group_members(kind, self.role)  # type: ignore[arg-type]
                pg = SwappableGroup(
                    self._prefix + self.layout.group_name(kind, self.role),  # type: ignore[arg-type]
                    members.index(self.role),
                    len(members),
                    lambda: self._current(kind),
                )
                register(pg, [self.layout.global_rank(m) for m in members], self._store)
                self._groups[kind] = pg
            return pg

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """A `DeviceMesh` of the job's layout (`Layout.mesh_dims`: size-1 dimensions left
        out) whose dimension groups are this role's c10d groups, so a migration swaps
        under the mesh exactly the groups of its delta; one per `ProcessGroups`."""
        with self._lock:
            if self._mesh is not None:
                return self._mesh
        dims = self.layout.mesh_dims()
        if not dims:
            raise LayoutMismatch(f"layout {self.layout.label} has one rank: no device mesh")
        init_process_group()  # the mesh places this rank through the default group
        names, shape = tuple(dims), [size for size, _ in dims.values()]
        mesh = torch.empty(shape, dtype=torch.int)
        for index in itertools.product(*(range(n) for n in shape)):
            at = dict(zip(names, index, strict=True))
            role = Role(
                dp=at.get("dp_replicate", 0) * self.layout.dp_shard + at.get("dp_shard", 0),
                pp=at.get("pp", 0),
                tp=at.get("tp", 0),
            )
            mesh[index] = self.layout.global_rank(role)
        groups: list[dist.ProcessGroup] = [self.get(kind) for _, kind in dims.values()]
        built = DeviceMesh.from_group(groups, device_type, mesh, mesh_dim_names=names)
        with self._lock:
            self._mesh = built
        return built

    def kinds_of(self, pg: dist.ProcessGroup) -> str | None:
        """The kind of one of my groups (None for any other group)."""
        return next((k for k, g in self._groups.items() if g is pg), None)

    def world(self) -> SwappableGroup:
        """The default group (see the module docstring)."""
        if self.dp_only:
            return self.get("dp")
        with self._lock:
            if self._world is None:
                world = self.layout.world_size
                self._world = SwappableGroup(
                    self._prefix + "world",
                    self.layout.global_rank(self.role),
                    world,
                    lambda: self._current("world"),
                )
                register(self._world, list(range(world)), self._store)
            return self._world

    def close(self) -> None:
        """Unregisters every group (a sandbox's, when its shadow round ends)."""
        with self._lock:
            for pg in [*self._groups.values(), *([self._world] if self._world else [])]:
                unregister(pg)
            self._groups.clear()
            self._world = None
            self._mesh = None


# -- the default group and torch.distributed's entry points ---------------------------

_ACTIVE: list[ProcessGroups] = []
_REAL_INIT = dist.init_process_group
_REAL_NEW_GROUP = dist.new_group


def active() -> ProcessGroups:
    if not _ACTIVE:
        raise RuntimeError(
            "no TrainMover role yet: call dist.init_process_group() / rt.process_group() "
            "after rt.wait_for_role() returned a role (or inside the shadow step)"
        )
    return _ACTIVE[-1]


def make_live(pgs: ProcessGroups) -> None:
    """The live role's groups: what `init_process_group` hands out outside a shadow."""
    _ACTIVE.insert(0, pgs)


def _set_default(pg: dist.ProcessGroup | None) -> None:
    c10d_world._update_default_pg(pg)


@contextmanager
def activated(pgs: ProcessGroups, default: bool) -> Iterator[ProcessGroups]:
    """Makes `pgs` the groups `init_process_group` and `rt.process_group` hand out while
    the block runs (a shadow round); with `default`, also the default group."""
    previous = c10d_world.GroupMember.WORLD
    _ACTIVE.append(pgs)
    if default:
        _set_default(pgs.world())
    try:
        yield pgs
    finally:
        _ACTIVE.remove(pgs)
        if default:
            _set_default(previous)


def init_process_group(
    backend: Any = None,
    init_method: str | None = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    **kwargs: Any,
) -> None:
    """`torch.distributed.init_process_group` under TrainMover: installs the runtime's
    default group (whatever backend is named: the runtime picks gloo or NCCL itself).
    A world size or rank that differs from the job's layout is refused."""
    pgs = active()
    world = pgs.world()
    if world_size not in (-1, world.size()) or rank not in (-1, world.rank()):
        raise LayoutMismatch(
            f"init_process_group(world_size={world_size}, rank={rank}), but the job config's "
            f"layout (tp={pgs.layout.tp}, pp={pgs.layout.pp}, dp={pgs.layout.dp}) gives "
            f"world_size={world.size()}, rank={world.rank()} to this worker"
        )
    if c10d_world.GroupMember.WORLD is not world:
        _set_default(world)


def new_group(*args: Any, **kwargs: Any) -> Any:
    raise UnsupportedCollective(
        "dist.new_group: a group built outside the TrainMover runtime cannot be replaced "
        "when a machine migrates (its collectives would hang on the leaver); take the group "
        "from the runtime: rt.process_group('tp' | 'pp' | 'dp'), or the whole mesh: "
        "rt.device_mesh()"
    )


def install_hooks() -> None:
    """Routes `dist.init_process_group` and `dist.new_group` to the runtime, also where
    `DeviceMesh` imported them by name (`init_device_mesh`, `_flatten`)."""
    for module in (dist, c10d_world, device_mesh_module):
        module.init_process_group = init_process_group  # type: ignore[attr-defined]
        module.new_group = new_group  # type: ignore[attr-defined]


def remove_hooks() -> None:
    for module in (dist, c10d_world, device_mesh_module):
        module.init_process_group = _REAL_INIT  # type: ignore[attr-defined]
        module.new_group = _REAL_NEW_GROUP  # type: ignore[attr-defined]
    _set_default(None)
    _ACTIVE.clear()


def set_torchrun_env(layout: Layout, role: Role, local_world: int, store_address: str) -> None:
    """What torchrun sets for a worker, once its role is known (a standby's comes from
    its plan)."""
    # The first replica: informational (the runtime's groups never use the variables).
    host, _, port = store_address.split(",")[0].rpartition(":")
    os.environ.update(
        {
            "RANK": str(layout.global_rank(role)),
            "WORLD_SIZE": str(layout.world_size),
            "LOCAL_RANK": str(role.tp),
            "LOCAL_WORLD_SIZE": str(local_world),
            "MASTER_ADDR": host,
            "MASTER_PORT": port,
        }
    )


# -- DDP --------------------------------------------------------------------------------


def check_ddp(model: DistributedDataParallel, pgs: ProcessGroups) -> str:
    """The kind of the runtime group a DDP model reduces over; refuses a DDP over any
    other group, or whose group's shape differs from the job's layout."""
    kind = pgs.kinds_of(model.process_group)
    if kind is None:
        raise UnsupportedCollective(
            "DistributedDataParallel over a process group the runtime did not hand out: "
            "build it with process_group=rt.process_group('dp') or after "
            "dist.init_process_group()"
        )
    if kind != "dp" and model.process_group.size() > 1:
        raise LayoutMismatch(
            f"DistributedDataParallel over the {kind} group ({model.process_group.size()} "
            f"ranks); the job's data-parallel size is dp={pgs.layout.dp}"
        )
    return kind


def realign(model: DistributedDataParallel) -> None:
    """On every member at the same boundary (when the model is tracked, and after its
    group was swapped): DDP's bucket layout and rebuilt-bucket state start over together
    (a joiner's fresh DDP would otherwise rebuild its buckets in its second step, a
    broadcast no stayer sends). The layout is DDP's own for a group change (every
    parameter pushed in order), never the one it rebuilds from the first backward's
    gradient order: a joiner has not run that backward, and from 3 members on gloo's
    ring sums each element in an order set by its offset in the bucket, so a layout
    that differs from the uninterrupted run's changes the numbers."""
    model._update_process_group(model.process_group)
    model.reducer._push_all_rebuilt_params()
    model.reducer._rebuild_buckets()
    model._has_rebuilt_buckets = True


def is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel)
