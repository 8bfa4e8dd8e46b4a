"""(d) of ``trainmover bench store``: the commit vote's share of the step, measured inside
the reference job at the largest size, through `trainmover up`'s stack.

The vote rounds of (b) time the agreement alone, and (a)'s job has 4 ranks; here the
reference job runs at `ranks` ranks on machines of `local` ranks (TP inside a machine,
two pipeline stages where they fit: TP4 x PP2 x DP2 at 16), and each machine reports
with its step statistics how long its local rank 0's vote took (`StepStats.vote_s`). A
rank's vote includes its wait for the slowest rank; the rank that arrives last waits for
no one, so per step the smallest vote over the machines is the agreement's own cost (at
most: the reporting ranks are local ranks 0, not always the last). Its median over the
steps, against the job's median step, is the vote's share of the job's step at that
size, on this host (where the job's ranks, and so its step, share its cores).
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from trainmover.bench.report import Progress, summary
from trainmover.localcluster import LocalCluster
from trainmover.messages import StepStats, decode
from trainmover.runtime.config import JobConfig
from trainmover.subjects import JobSubjects

#: Steps of the job left out before measuring (start-up, first steps of each rank).
SETTLE_STEPS = 30
WAIT_S = 600.0


def job_config(ranks: int, local: int) -> JobConfig:
    """The reference job at `ranks` ranks on machines of `local` ranks, no standby."""
    pp = 2 if ranks % (2 * local) == 0 else 1
    dp = ranks // (local * pp)
    return JobConfig(job="storevote").with_updates(
        layout={"tp": local, "pp": pp, "dp": dp},
        train={"steps": 100_000},
        runtime={"group_timeout_s": 60},
        cluster={"machines": [f"m{i}" for i in range(pp * dp)], "standbys": []},
    )


def share(stats: list[StepStats]) -> dict[str, Any]:
    """From the machines' statistics of the measured steps: the median step, the
    agreement's cost per step (the smallest vote over the machines, on steps every
    machine reported) and its share of the step."""
    by_step: dict[int, dict[str, StepStats]] = {}
    for s in stats:
        by_step.setdefault(s.step, {})[s.machine] = s
    machines = {s.machine for s in stats}
    complete = sorted(step for step, got in by_step.items() if set(got) == machines)
    votes = [min(s.vote_s for s in by_step[step].values()) for step in complete]
    gaps = [
        by_step[b][m].ts - by_step[a][m].ts
        for a, b in zip(complete, complete[1:], strict=False)
        if b == a + 1
        for m in machines
    ]
    step_s = statistics.median(gaps)
    vote_s = statistics.median(votes)
    return {
        "steps": len(complete),
        "median_step_ms": 1e3 * step_s,
        "vote_ms": 1e3 * vote_s,
        "vote": summary(1e3 * v for v in votes),
        "share_of_step": vote_s / step_s,
    }


async def vote_in_job(
    ranks: int, local: int, steps: int, run_dir: Path, progress: Progress, shards: int = 0
) -> dict[str, Any]:
    """Runs the reference job at `ranks` ranks (its store with `shards` shards) and
    measures `steps` of its steps."""
    config = job_config(ranks, local)
    stats: list[StepStats] = []
    first = SETTLE_STEPS
    last = first + steps
    async with LocalCluster(config, run_dir, store_shards=shards) as cluster:
        progress.note(f"the reference job at {ranks} ranks ({config.layout}): starting")

        async def on_stats(msg: Msg) -> None:
            s = decode(StepStats, msg.data)
            if first <= s.step <= last:
                stats.append(s)

        sub = await cluster.nc.subscribe(JobSubjects(config.job).all_stats, cb=on_stats)
        try:
            for machine in config.cluster.machines:
                await cluster.wait_step(machine, last, WAIT_S)
            await cluster.nc.flush()
        finally:
            await sub.unsubscribe()
    out = share(stats)
    out.update(ranks=ranks, local_ranks=local, shards=shards, layout=config.layout.model_dump())
    return out


def run(
    ranks: int, local: int, steps: int, run_dir: Path, progress: Progress, shards: int = 0
) -> dict[str, Any]:
    return asyncio.run(vote_in_job(ranks, local, steps, run_dir, progress, shards))
