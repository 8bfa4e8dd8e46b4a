"""``trainmover bench hangs``: how fast a hung machine is named and moved, by hang kind.

Through the product path (`LocalCluster`: nats-server, planner, executor, health-monitor,
sidecars, real workers), on the reference job with three standbys:

- ``sigstop``: both workers of a machine frozen with SIGSTOP (alive, sockets open, its
  sidecar heartbeating);
- ``stuck``: both workers of a machine stuck outside any collective (the control
  command `slow` with a minute (its most) of extra compute after their vote);
- ``blocked``: one worker of a machine deadlocked in an extra collective of its TP group
  that its peer, alive and past its vote, never joins (the control command `block`);
- ``cut``: a machine's network link taken down (packets dropped, no reset: its TCP
  connections stay open, its processes run on), where this host can build network
  namespaces (root, iproute2): the cluster then runs on a private bridge with that
  machine in a namespace of its own (`trainmover.netns`);
- ``timeout`` (what the job got before the progress board): the same SIGSTOP with stall
  detection off, ended by `runtime.failure_timeout_s` only.

For each: detection (hang -> the failure event's timestamp), the migration's downtime as
the executor measures it, and whether the right machine was named. JSON (+ .md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from trainmover import bus, netns
from trainmover.bench.report import Progress, Result, markdown_table, outputs
from trainmover.localcluster import LocalCluster
from trainmover.messages import Command, FailureEvent, StepStats, decode
from trainmover.runtime.config import JobConfig
from trainmover.subjects import JobSubjects

WAIT_S = 600.0
CONFIG = JobConfig(job="hangs").with_updates(
    train={"steps": 1_000_000, "dump_steps": []},
    cluster={"standbys": ["s0", "s1", "s2", "s3"], "maintenance_s": 3600.0},
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, required=True, help="result file (.md beside)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=120.0,
        help="runtime.failure_timeout_s, the last resort and the baseline (default 120)",
    )
    parser.add_argument("--skip-baseline", action="store_true", help="leave out `timeout`")
    parser.add_argument("--run-dir", type=Path, help="where the clusters run (default: temp)")


async def _median_step_s(cluster: LocalCluster, machine: str, steps: int = 10) -> float:
    """Median time between `machine`'s step statistics over its next `steps` steps."""
    stamps: list[float] = []
    enough = asyncio.Event()

    async def on_stats(msg: Msg) -> None:
        stamps.append(decode(StepStats, msg.data).ts)
        if len(stamps) > steps:
            enough.set()

    sub = await cluster.nc.subscribe(JobSubjects(cluster.job).stats(machine), cb=on_stats)
    try:
        await asyncio.wait_for(enough.wait(), WAIT_S)
    finally:
        await sub.unsubscribe()
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))


async def _hang(cluster: LocalCluster, kind: str, machine: str, lan: netns.Lan | None) -> float:
    """Hangs `machine` the `kind` way; returns the wall time it hung."""
    if kind == "cut":
        assert lan is not None
        hung = time.time()
        await asyncio.to_thread(lan.cut, machine)
        return hung
    commands = {
        "stuck": Command(job=cluster.job, machine=machine, op="slow", args={"extra_s": 60.0}),
        "blocked": Command(
            job=cluster.job, machine=machine, op="block", args={"group": "tp", "local_rank": 0}
        ),
    }
    if kind in commands:
        command = commands[kind]
        op = command.op
        reply = await bus.request(cluster.nc, command, timeout=10.0, deadline_s=WAIT_S)
        if not reply.ok:
            raise RuntimeError(f"{op} on {machine}: {reply.error}")
        return time.time()
    pids = await cluster.worker_pids(machine, WAIT_S)
    hung = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return hung


async def _measure(
    cluster: LocalCluster, kind: str, machine: str, lan: netns.Lan | None = None
) -> dict[str, Any]:
    median = await _median_step_s(cluster, "m0")
    async with cluster.client.watch(cluster.job) as items:
        hung = await _hang(cluster, kind, machine, lan)

        async def failure() -> FailureEvent:
            async for item in items:
                if isinstance(item, FailureEvent):
                    return item
            raise RuntimeError("watch ended")

        event = await asyncio.wait_for(failure(), WAIT_S)
    done = await cluster.client.wait_for_migration(cluster.job, event.event_id, timeout=WAIT_S)
    return {
        "kind": kind,
        "hung": machine,
        "named": event.machine,
        "named_correctly": event.machine == machine,
        "source": event.source,
        "detection_s": event.ts - hung,
        "downtime_s": done.downtime_s,
        "state": done.state,
        "median_step_s": median,
        "reason": event.reason,
    }


async def _run(args: argparse.Namespace, progress: Progress) -> list[dict[str, Any]]:
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-hangs-"))
    rows: list[dict[str, Any]] = []
    config = CONFIG.with_updates(runtime={"failure_timeout_s": args.timeout_s})
    kinds = [("sigstop", "m1"), ("stuck", "m2"), ("blocked", "m3")]
    with contextlib.ExitStack() as stack:
        lan: netns.Lan | None = None
        if netns.available():
            lan = stack.enter_context(netns.private_lan())
            lan.add("m0")
            kinds.append(("cut", "m0"))
        else:
            progress.step("cut: left out (network namespaces need root and iproute2)")
        async with LocalCluster(
            config,
            run_dir / "detected",
            host=lan.host_address if lan else "127.0.0.1",
            machine_wrap=lan.machine_wrap({"m0"}) if lan else None,
        ) as cluster:
            await cluster.wait_step("m0", 20, WAIT_S)
            await cluster.wait_standbys_warm(WAIT_S)
            for kind, machine in kinds:
                rows.append(await _measure(cluster, kind, machine, lan))
                progress.step(f"{kind}: detection {rows[-1]['detection_s']:.2f}s")
    if not args.skip_baseline:
        off = config.with_updates(runtime={"stall_detection": False})
        async with LocalCluster(off, run_dir / "timeout") as cluster:
            await cluster.wait_step("m0", 20, WAIT_S)
            await cluster.wait_standbys_warm(WAIT_S)
            rows.append({**await _measure(cluster, "sigstop", "m1"), "kind": "timeout"})
            progress.step(f"timeout: detection {rows[-1]['detection_s']:.2f}s")
    return rows


def main(args: argparse.Namespace) -> int:
    progress = Progress("hangs", 4 + (0 if args.skip_baseline else 1))
    rows = asyncio.run(_run(args, progress))
    result = Result("hangs", timeout_s=args.timeout_s)
    result.set("rows", rows)
    detected = [r for r in rows if r["kind"] != "timeout"]
    baseline = next((r for r in rows if r["kind"] == "timeout"), None)
    for r in detected:
        goal = max(2.0, 5 * r["median_step_s"])
        r["detection_goal_s"] = goal
        r["detection_met"] = r["detection_s"] <= goal
        if baseline is not None:
            r["detection_speedup_vs_timeout"] = baseline["detection_s"] / r["detection_s"]
    path = result.write(args.json)
    table = markdown_table(
        ["kind", "hung", "named", "detection s", "downtime s", "median step s"],
        [
            [
                r["kind"],
                r["hung"],
                r["named"],
                r["detection_s"],
                r["downtime_s"],
                r["median_step_s"],
            ]
            for r in rows
        ],
    )
    outputs(path)[0].write_text(table)
    print(table)
    return 0 if all(r["named_correctly"] for r in rows) else 1
