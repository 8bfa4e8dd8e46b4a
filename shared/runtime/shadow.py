"""Shadow iterations: a standby warms up for every role type without touching the job.

For each role type asked for ("first", "middle", "last"; "only" when PP=1) the standby
builds the representative role's model, optimizer and data with the user's own code
(`ShadowFn`), over sandbox groups (`trainmover.runtime.sandbox`), and runs real forward,
backward and optimizer iterations. Then everything built is dropped: parameters,
optimizer state, step counters, RNG and data position of a shadow iteration can never
survive into training (the joiner builds its role afresh and the transferred state
overwrites it anyway). What stays is process-wide warmth, bounded by the process itself:
imported code (e.g. torch._dynamo, which the first Adam pulls in), kernels and the
allocator's pools, and, for a compiled model, the compiled graphs and inductor's cache.
`kept_bytes` in the answer measures what would break this: the storage of tensors that
the shadow created and that are still reachable once it is over.
"""

from __future__ import annotations

import functools
import gc
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from trainmover.runtime import control as c
from trainmover.runtime import pipelines
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Layout, Role
from trainmover.runtime.pgs import ProcessGroups, activated
from trainmover.runtime.plan import RankRef
from trainmover.runtime.sandbox import (
    LocalGroup,
    RecordStore,
    SandboxGroup,
    SandboxStats,
    await_record,
    load_record,
    load_shapes,
    local_tp_group,
    record_key,
    sandbox_specs,
    seed_for,
)

#: Given a role and the sandbox's groups, build the role (model, optimizer, data) and
#: return a function that runs one full training iteration.
ShadowFn = Callable[[Role, GroupTable], Callable[[], object]]


def rss_bytes() -> int:
    """Resident memory of this process."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def live_tensors() -> list[torch.Tensor]:
    """Every tensor object alive in this process that Python can reach."""
    # type(), not isinstance: some lazy module objects warn when asked their __class__.
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


#: The tensors alive at a point in time, by id (a weak reference tells a reused id).
TensorSnapshot = dict[int, weakref.ref[torch.Tensor]]


def snapshot_tensors() -> TensorSnapshot:
    return {id(t): weakref.ref(t) for t in live_tensors()}


def kept_bytes(before: TensorSnapshot) -> int:
    """Bytes of storage held by tensors created since `before` and still alive, once per
    storage; storage shared with a tensor of `before` (a view of it) and meta tensors
    hold none."""
    gc.collect()
    old: set[int] = set()
    new: dict[int, int] = {}
    for tensor in live_tensors():
        try:
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
            continue
        ref = before.get(id(tensor))
        if ref is not None and ref() is tensor:
            old.add(storage.data_ptr())
        else:
            new[storage.data_ptr()] = storage.nbytes()
    return sum(n for ptr, n in new.items() if ptr not in old)


def run_shadow(
    me: RankRef,
    layout: Layout,
    warm: c.Warm,
    shadow: ShadowFn,
    records: RecordStore,
    sandbox_dir: Path,
    round_id: str,
    timeout_s: float,
    store_known: bool,
    records_wait_s: float = 0.0,
) -> c.Warmed:
    """Runs `warm.iterations` shadow iterations for each of `warm.role_types`;
    `kept_bytes` measures the tensors that outlive them. A role type whose shadow fails
    before any live rank recorded it (with pipeline parallelism) waits up to
    `records_wait_s` for the recording, then runs again."""
    before = snapshot_tensors()
    stats = SandboxStats()
    times: dict[str, list[float]] = {}
    for role_type in warm.role_types:
        recorded = layout.pp == 1 or records.get(record_key(role_type)) is not None
        attempt = functools.partial(
            _shadow_role,
            role_type,
            me,
            layout,
            warm.iterations,
            shadow,
            records,
            sandbox_dir,
            f"{round_id}.{role_type}",
            timeout_s,
            stats,
        )
        try:
            times[role_type] = attempt()
        except Exception:
            # A stage that learns its shapes from a recording (a torch pipeline built
            # without them) cannot run before a live rank made one: a standby started
            # with its job waits for it, then tries again.
            waited = not recorded and records_wait_s > 0
            if not (waited and await_record(records, role_type, records_wait_s)):
                raise
            times[role_type] = attempt()
        gc.collect()
    return c.Warmed(
        role_types=list(warm.role_types),
        iteration_s=times,
        replayed=stats.replayed,
        synthesized=stats.synthesized,
        local=stats.local,
        store_known=store_known,
        kept_bytes=kept_bytes(before),
        rss_bytes=rss_bytes(),
    )


def _shadow_role(
    role_type: str,
    me: RankRef,
    layout: Layout,
    iterations: int,
    shadow: ShadowFn,
    records: RecordStore,
    sandbox_dir: Path,
    sandbox_id: str,
    timeout_s: float,
    stats: SandboxStats,
) -> list[float]:
    """The shadow iterations of one role type; what they built dies with this frame."""
    role = layout.role_of_type(role_type, me.local_rank)
    specs = sandbox_specs(me.machine, layout, sandbox_id)
    tp = LocalGroup(local_tp_group(specs["tp"], me, sandbox_dir, timeout_s), stats)
    record = load_record(records, role_type)
    groups = GroupTable()
    seed = seed_for(role_type, role.tp)
    groups.install(
        [
            tp,
            *(
                SandboxGroup(
                    spec,
                    layout.rank_and_size(kind, role)[0],  # type: ignore[arg-type]
                    record if kind == "pp" else {},  # pipeline receives are replayed
                    stats,
                    seed,
                )
                for kind, spec in specs.items()
                if kind != "tp"
            ),
        ]
    )
    rng = torch.get_rng_state()  # the shadow must not move the process's global RNG
    # c10d groups over the sandbox's, the default group among them, for a loop
    # written against standard PyTorch (DDP, dist.init_process_group()).
    c10d = ProcessGroups(layout, role, groups.get, dist.HashStore(), f"{specs['world'].name}/")
    times = []
    try:
        with activated(c10d, default=True), pipelines.lending(load_shapes(records, role_type)):
            step = shadow(role, groups)
            for _ in range(iterations):
                started = time.perf_counter()
                step()
                times.append(time.perf_counter() - started)
    finally:
        torch.set_rng_state(rng)
        c10d.close()
        groups.shutdown()
        forget_sandbox_meshes()
    return times


def forget_sandbox_meshes() -> None:
    """Drops DTensor's caches of sharding decisions. They are keyed by `DeviceMesh`
    equality, which compares ranks and dimension names, not groups: a sandbox mesh is
    equal to the live mesh of the same layout, so a decision cached in a shadow step
    would hand the live model the sandbox's mesh (its groups, its coordinates)."""
    _clear_sharding_prop_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def warm_up(
    me: RankRef,
    layout: Layout,
    warm: c.Warm,
    shadow: ShadowFn | None,
    records: RecordStore,
    sandbox_dir: Path,
    round_id: str,
    timeout_s: float,
    store_known: bool,
    log: structlog.stdlib.BoundLogger,
    records_wait_s: float = 0.0,
) -> c.Warmed:
    """A standby's answer to `warm`: `run_shadow`, or the error that stopped it (a
    failed warm-up leaves a usable, cold, standby)."""
    try:
        if shadow is None:
            raise RuntimeError("this job gave wait_for_role no shadow step")
        warmed = run_shadow(
            me, layout, warm, shadow, records, sandbox_dir, round_id, timeout_s, store_known,
            records_wait_s,
        )  # fmt: skip
    except Exception as exc:
        log.exception("warm_failed")
        warmed = c.Warmed(
            role_types=[],
            iteration_s={},
            replayed=0,
            synthesized=0,
            local=0,
            store_known=store_known,
            kept_bytes=0,
            rss_bytes=0,
            error=f"{type(exc).__name__}: {exc}",
        )
    log.info(
        "warmed",
        role_types=warmed.role_types,
        iteration_s=warmed.iteration_s,
        replayed=warmed.replayed,
        synthesized=warmed.synthesized,
    )
    return warmed
