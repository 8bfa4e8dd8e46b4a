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
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainmover.runtime import control as c
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Layout, Role
from trainmover.runtime.pgs import ProcessGroups, activated
from trainmover.runtime.plan import RankRef
from trainmover.runtime.sandbox import (
    LocalGroup,
    RecordStore,
    SandboxGroup,
    SandboxStats,
    load_record,
    local_tp_group,
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
) -> c.Warmed:
    """Runs `warm.iterations` shadow iterations for each of `warm.role_types`."""
    stats = SandboxStats()
    times: dict[str, list[float]] = {}
    for role_type in warm.role_types:
        role = layout.role_of_type(role_type, me.local_rank)
        specs = sandbox_specs(me.machine, layout, f"{round_id}.{role_type}")
        tp = LocalGroup(local_tp_group(specs["tp"], me, sandbox_dir, timeout_s), stats)
        record = load_record(records, role_type)
        groups = GroupTable()
        groups.install(
            [
                tp,
                SandboxGroup(specs["pp"], role.pp, record, stats, seed_for(role_type, role.tp)),
                SandboxGroup(specs["dp"], role.dp, {}, stats, seed_for(role_type, role.tp)),
            ]
        )
        rng = torch.get_rng_state()  # the shadow must not move the process's global RNG
        # c10d groups over the sandbox's, the default group among them, for a loop
        # written against standard PyTorch (DDP, dist.init_process_group()).
        c10d = ProcessGroups(layout, role, groups.get, dist.HashStore(), f"{specs['dp'].name}/")
        try:
            with activated(c10d, default=True):
                step = shadow(role, groups)
                times[role_type] = []
                for _ in range(warm.iterations):
                    started = time.perf_counter()
                    step()
                    times[role_type].append(time.perf_counter() - started)
                del step
        finally:
            torch.set_rng_state(rng)
            c10d.close()
            groups.shutdown()
        gc.collect()
    return c.Warmed(
        role_types=list(warm.role_types),
        iteration_s=times,
        replayed=stats.replayed,
        synthesized=stats.synthesized,
        local=stats.local,
        store_known=store_known,
        kept_bytes=0,
        rss_bytes=rss_bytes(),
    )
