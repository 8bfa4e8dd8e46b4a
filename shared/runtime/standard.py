"""The standard-PyTorch face of a worker's runtime: c10d groups, torchrun env, DDP.

`StandardTorch` is what `Runtime` delegates to so that a torchrun script runs under it:
once the rank has a role it sets torchrun's environment and makes the role's
`ProcessGroups` live (`dist.init_process_group()` then installs the runtime's group), it
keeps the DDP models the loop tracked and realigns their reducers after a switch that
replaced their group, and it tells a step that DDP's reducer failed in (a c10d work with
an error) from a bug of the loop.

Before a joiner switches in, its groups are sandboxed stand-ins (`SandboxGroup`: every
collective answered locally), so a DDP it builds for its role runs its start-up
collectives without talking to the live job; the switch replaces them with the live
groups, and every member then realigns together.

The default group of a TP/PP layout forwards to the rank's `LazyWorld`
(`trainmover.runtime.world`): built at its first collective, dropped at every switch.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from trainmover.runtime import c10d, pgs, pipelines
from trainmover.runtime.groups import Group, GroupTable
from trainmover.runtime.layout import Layout, Role
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.sandbox import SandboxGroup, SandboxStats
from trainmover.runtime.world import LazyWorld


class StandardTorch:
    """One worker's c10d groups, tracked DDP models and torchrun environment."""

    def __init__(self, layout: Layout, groups: GroupTable, before_use: Callable[[], None]):
        self.layout = layout
        self.groups = groups
        #: Installs the rank's initial groups if they are still being built: a DDP
        #: constructed before the first step needs its real group.
        self._before_use = before_use
        self.live: pgs.ProcessGroups | None = None
        self._standins: dict[str, Group] = {}
        self._ddp: list[tuple[torch.nn.Module, str]] = []
        #: The world group of a TP/PP layout, made once the rank has a role by
        #: `new_world` (set by the runtime, which owns the store and the builders).
        self.world: LazyWorld | None = None
        self.new_world: Callable[[Role], LazyWorld] | None = None
        pgs.install_hooks()
        pipelines.install()

    def take_role(self, role: Role, store_address: str) -> None:
        """The rank has a role: torchrun's environment, and its c10d groups go live."""
        pgs.set_torchrun_env(self.layout, role, self.layout.tp, store_address)
        if self.live is None:
            self.live = pgs.ProcessGroups(self.layout, role, self._current, dist.HashStore())
            pgs.make_live(self.live)
            if not self.live.dp_only and self.new_world is not None:
                self.world = self.new_world(role)

    def _current(self, kind: str) -> Group | None:
        self._before_use()
        if kind != "world":
            return self.groups.get(kind) or self._standin(kind)
        if self.groups.get("tp") is None or self.world is None:
            return self._standin(kind)  # a joiner before its switch (every role has a tp group)
        return self.world.current()

    def _standin(self, kind: str) -> Group:
        group = self._standins.get(kind)
        if group is None:
            assert self.live is not None
            role = self.live.role
            rank, size = self.layout.rank_and_size(kind, role)  # type: ignore[arg-type]
            spec = GroupSpec(
                name=f"standin.{kind}",
                kind=kind,  # type: ignore[arg-type]
                generation=0,
                members=[RankRef(machine="sandbox", local_rank=i) for i in range(size)],
            )
            seed = zlib.crc32(f"standin/{role.key}/{kind}".encode())
            group = SandboxGroup(spec, rank, {}, SandboxStats(), seed)
            self._standins[kind] = group
        return group

    def process_group(self, kind: str) -> dist.ProcessGroup:
        return pgs.active().get(kind)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        return pgs.active().device_mesh(device_type)

    def track(self, model: torch.nn.Module) -> None:
        """Remembers a DDP model (refusing one over a group the runtime does not own) and
        gives it the bucket layout every realignment gives (`pgs.realign`), so a run
        with replacements reduces in the same layout as one without."""
        if pgs.is_ddp(model) and self.live is not None:
            self._ddp.append((model, pgs.check_ddp(model, self.live)))  # type: ignore[arg-type]
            pgs.realign(model)  # type: ignore[arg-type]

    def discard_step(self, model: torch.nn.Module) -> None:
        """After a discarded step, on the training thread: FSDP2's per-iteration state
        (unsharded parameters, collectives in flight, hooks' training states) is reset
        on each root FSDP module, as after any exception mid forward or backward, so the
        re-executed step all-gathers and reduces exactly as on a fresh joiner."""
        fsdp = [(m, m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)]
        with c10d.discarding():
            for module, state in fsdp:
                if state._is_root:
                    module.reset_iter_state()
        # The reset leaves the gradients that a layer's backward wrote before its
        # reduce-scatter failed on the unsharded parameters (torch 2.13): the
        # re-executed backward would add to them.
        for _, state in fsdp:
            for param_group in state._fsdp_param_groups:
                for param in param_group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):
                        param._unsharded_param.grad = None

    def installed(self, kinds: list[str], recovery: bool = False, shapes: str = "") -> None:
        """After a switch or a `recovery` installed new groups of `kinds`: every DDP over
        one of them is realigned (all its members do this at the same boundary), the
        world group, whose members changed, is dropped (the next world collective builds
        it), and the pipeline schedules restart where every member of their pipeline
        does (`trainmover.runtime.pipelines`; a joiner's stages take the leaver's
        `shapes`)."""
        if self.world is not None:
            self.world.drop()
        for model, kind in self._ddp:
            if kind in kinds:
                pgs.realign(model)  # type: ignore[arg-type]
        if recovery:
            pipelines.restart(pinned=False)
        elif "pp" in kinds:
            pipelines.restart(pinned=True, lent=shapes)

    def c10d_failed(self) -> bool:
        """A c10d work of one of the rank's groups failed (reported through the abort
        signal by the group)."""
        world = [self.world.built] if self.world is not None and self.world.built else []
        return any([g.c10d_failure() is not None for g in [*self.groups.values(), *world]])

    def close(self) -> None:
        if self.world is not None:
            self.world.close()
        pgs.remove_hooks()
        pipelines.remove()
