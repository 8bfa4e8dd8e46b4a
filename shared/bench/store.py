"""``trainmover bench store``: what the rendezvous store's loss costs a training job, and
what its failover costs every step.

(a) Store loss: a TrainMover job (one rank per machine, 4 machines, 2 standbys) through
`trainmover up`'s stack with the store as two rendezvous service replicas; the serving
replica is SIGKILLed `--kills` times while the job trains. Per loss: the training time
lost, i.e. the longest gap between two steps of any machine around the loss, less the
median step.
(b) The per-step commit vote: rounds of `--steps` votes at 4, 8 and 16 ranks, one
process per rank, alternating the runtime's own agreement (failover client) with the
same vote on a bare TCPStore (the store before it had replicas), side by side in one
run. A linear fit of the median vote against the number of ranks projects it to 1,024
ranks; both are put beside the job's median step from (a).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainmover.bench import plot
from trainmover.bench.report import Progress, Result, markdown_table, outputs, ratio, summary
from trainmover.localcluster import LocalCluster
from trainmover.runtime.config import JobConfig
from trainmover.runtime.rendezvous import RendezvousHost

WAIT_S = 600.0
MODES = ("trainmover", "tcpstore")
#: Votes of a round's start left out (processes starting at different times).
WARMUP = 5
PROJECTED_RANKS = 1024
CONFIG = JobConfig(job="storeloss").with_updates(
    layout={"tp": 1},
    train={"steps": 100_000},
    runtime={"group_timeout_s": 60},
    cluster={"standbys": ["s0", "s1"], "maintenance_s": 3600.0},
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, required=True, help="result file (.md beside)")
    parser.add_argument("--kills", type=int, default=3, help="store losses in (a) (default 3)")
    parser.add_argument(
        "--ranks", default="4,8,16", help="world sizes of the vote rounds (default 4,8,16)"
    )
    parser.add_argument("--steps", type=int, default=60, help="votes per round (default 60)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode and size")
    parser.add_argument("--run-dir", type=Path, help="where the job runs (default: temp)")


# -- (a) the store's loss ------------------------------------------------------------------


def _lost_s(stamps: dict[str, dict[int, float]], killed_at: float, median: float) -> float:
    """The longest gap between two consecutive steps of any machine that spans or
    follows the loss (within 30 s), less the median step."""
    worst = 0.0
    for steps in stamps.values():
        ordered = sorted(steps.items())
        for (_, a), (_, b) in zip(ordered, ordered[1:], strict=False):
            if b >= killed_at and a <= killed_at + 30:
                worst = max(worst, b - a)
    return max(worst - median, 0.0)


def _median_step(stamps: dict[str, dict[int, float]], before: float) -> float:
    gaps = []
    for steps in stamps.values():
        ordered = [t for _, t in sorted(steps.items()) if t < before]
        gaps += [b - a for a, b in zip(ordered, ordered[1:], strict=False)]
    return statistics.median(gaps)


async def _losses(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-store-"))
    rows: list[dict[str, Any]] = []
    async with LocalCluster(CONFIG, run_dir, store_replicas=2) as cluster:
        machines = CONFIG.cluster.machines
        await cluster.wait_step("m0", 30, WAIT_S)
        await cluster.wait_standbys_warm(WAIT_S)
        for i in range(args.kills):
            median = _median_step(cluster.step_ts, time.time())
            name, incarnation = cluster.stack.serving_replica()
            killed_at = time.time()
            await cluster.stack.restart_service(name)
            for machine in machines:  # every machine trained on past the loss
                await cluster.wait_step_after(machine, killed_at + 5, WAIT_S)
            _, now = cluster.stack.serving_replica()
            state = await cluster.wait_state(lambda s: s.revision >= 0, WAIT_S)
            rows.append(
                {
                    "killed": name,
                    "lost_s": _lost_s(cluster.step_ts, killed_at, median),
                    "median_step_s": median,
                    "new_incarnation": now != incarnation,
                    "failures_declared": sum(m.status == "failed" for m in state.machines.values()),
                    "in_flight": len(state.in_flight),
                }
            )
            progress.step(f"store loss {i + 1}: {rows[-1]['lost_s']:.2f}s of training lost")
            await cluster.wait_step("m0", max(cluster.steps.values()) + 20, WAIT_S)
    lost: list[float] = [r["lost_s"] for r in rows]
    return {
        "rows": rows,
        "lost_s_median": statistics.median(lost),
        "lost_s_max": max(lost),
        "median_step_s": statistics.median(float(r["median_step_s"]) for r in rows),
    }


# -- (b) the per-step vote -----------------------------------------------------------------


def _round(mode: str, world: int, steps: int) -> list[float]:
    """One round: `world` processes voting `steps` times on a fresh store replica."""
    host = RendezvousHost()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "trainmover.bench.store_worker", host.address,
                 str(rank), str(world), mode, str(steps)],
                stdout=subprocess.PIPE, text=True,
            )
            for rank in range(world)
        ]  # fmt: skip
        seconds: list[float] = []
        for proc in procs:
            out, _ = proc.communicate(timeout=WAIT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"a {mode} voter exited with code {proc.returncode}")
            seconds += json.loads(out)[WARMUP:]
        return seconds
    finally:
        host.close()


def _votes(args: argparse.Namespace, progress: Progress) -> list[dict[str, Any]]:
    """Per world size: each mode's median vote (ms) and its spread (`<mode>_vote`)."""
    sizes = [int(n) for n in args.ranks.split(",")]
    samples: dict[tuple[str, int], list[float]] = {(m, n): [] for m in MODES for n in sizes}
    for _ in range(args.rounds):
        for world in sizes:
            for mode in MODES:  # side by side: alternating in one run
                samples[(mode, world)] += _round(mode, world, args.steps)
                median_ms = 1e3 * statistics.median(samples[(mode, world)])
                progress.step(f"{mode} vote at {world} ranks: median {median_ms:.2f} ms")
    rows = []
    for world in sizes:
        row: dict[str, Any] = {"ranks": world}
        for mode in MODES:
            ms = [1e3 * v for v in samples[(mode, world)]]
            row[f"{mode}_vote_ms"] = statistics.median(ms)
            row[f"{mode}_vote"] = summary(ms)
        row["ratio"] = ratio(row["trainmover_vote_ms"], row["tcpstore_vote_ms"])
        rows.append(row)
    return rows


def _projection(rows: list[dict[str, Any]], mode: str) -> dict[str, float]:
    """vote_ms = a + b * ranks, fitted; the store serves each rank's requests in turn."""
    x = np.array([r["ranks"] for r in rows], dtype=float)
    y = np.array([r[f"{mode}_vote_ms"] for r in rows])
    b, a = np.polyfit(x, y, 1) if len(rows) > 1 else (0.0, float(y[0]))
    return {
        "a_ms": float(a),
        "b_ms_per_rank": float(b),
        "at_1024_ms": float(a + b * PROJECTED_RANKS),
    }


def main(args: argparse.Namespace) -> int:
    sizes = args.ranks.split(",")
    progress = Progress("store", args.kills + args.rounds * len(sizes) * len(MODES))
    losses = asyncio.run(_losses(args, progress))
    votes = _votes(args, progress)
    step_ms = 1e3 * losses["median_step_s"]
    projection = {m: _projection(votes, m) for m in MODES}
    for row in votes:
        row["trainmover_share_of_step"] = row["trainmover_vote_ms"] / step_ms
    result = Result("store", kills=args.kills, ranks=args.ranks, steps=args.steps)
    result.set("loss", losses)
    result.set("votes", votes)
    result.set("projection", projection)
    largest = votes[-1]
    result.set(
        "goals",
        {
            "lost_s_max": losses["lost_s_max"],
            "lost_met": losses["lost_s_max"] <= 2.0,
            "vote_share_at_largest": largest["trainmover_share_of_step"],
            "vote_share_met": largest["trainmover_share_of_step"] <= 0.05,
            "projected_share_at_1024": projection["trainmover"]["at_1024_ms"] / step_ms,
            "projected_met": projection["trainmover"]["at_1024_ms"] / step_ms <= 0.10,
        },
    )
    path = result.write(args.json)
    loss_table = markdown_table(
        ["loss", "killed", "training lost s", "median step s", "failures declared"],
        [
            [i + 1, r["killed"], r["lost_s"], r["median_step_s"], r["failures_declared"]]
            for i, r in enumerate(losses["rows"])
        ],
    )
    vote_table = markdown_table(
        ["ranks", "TrainMover vote ms", "bare TCPStore vote ms", "ratio", "share of step"],
        [
            [r["ranks"], r["trainmover_vote_ms"], r["tcpstore_vote_ms"], r["ratio"],
             r["trainmover_share_of_step"]]
            for r in votes
        ],
    )  # fmt: skip
    p = projection["trainmover"]
    text = (
        f"{loss_table}\n\n{vote_table}\n\nprojected vote at {PROJECTED_RANKS} ranks: "
        f"{p['at_1024_ms']:.1f} ms ({p['a_ms']:.2f} + {p['b_ms_per_rank']:.3f} x ranks), "
        f"{100 * result.get('goals.projected_share_at_1024'):.1f}% of the job's median step\n"
    )
    md, png = outputs(path)
    md.write_text(text)
    plot.lines(
        png,
        "Per-step commit vote vs ranks (loopback)",
        [r["ranks"] for r in votes],
        {
            "TrainMover (failover store client)": [r["trainmover_vote"] for r in votes],
            "bare TCPStore": [r["tcpstore_vote"] for r in votes],
        },
        "ranks",
        "ms per vote",
    )
    print(text)
    fine = all(r["new_incarnation"] and not r["failures_declared"] for r in losses["rows"])
    return 0 if fine else 1
