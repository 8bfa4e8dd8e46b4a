"""``trainmover bench store``: what the rendezvous store's loss costs a training job, and
what its failover costs every step.

(a) Store loss: a TrainMover job (one rank per machine, 4 machines, 2 standbys) through
`trainmover up`'s stack with the store as two rendezvous service replicas; the serving
replica is SIGKILLed `--kills` times while the job trains. Per loss: the training time
lost, i.e. the longest gap between two steps of any machine around the loss, less the
median step.
(b) The per-step commit vote: rounds of `--steps` votes at 4, 8 and 16 ranks, one
process per rank, alternating three modes side by side in one run: the runtime's own
agreement with one voter per machine of `--local-ranks` ranks (each machine's ranks
count their votes in its own store), the same agreement with every rank a voter, and
the flat vote on a bare TCPStore (the store before it had replicas). Per mode: the
median vote, and the job's store's CPU time per step (it serves every machine of the
job: the part that does not shrink when ranks get their own cores, as they have on a
real cluster; on this host it also grows with the processes contending). Projection to
1,024 ranks on machines of 8: the smallest round's vote as measured, plus the job's
store's CPU per voter (calibrated by 4 clients playing 4 voters' requests each at once,
which keeps the store busy as a large job does) times the further voters. Both are put
beside the job's median step from (a).
(c) The progress board at the largest size: every rank's beacon for a few seconds, each
rank writing its entry to the job's store, then folded per machine; the job's store's
CPU per second, and at 1,024 ranks the writes per second and their CPU as calibrated.
(d) The vote inside the reference job at the largest size (`trainmover.bench.store_job`):
its share of that job's step, measured in it.
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

from trainmover.bench import plot, store_job, store_projection
from trainmover.bench.report import Progress, Result, markdown_table, outputs, ratio, summary
from trainmover.bench.store_projection import PROJECTED_LOCAL, PROJECTED_RANKS, VOTER_REQUESTS
from trainmover.localcluster import LocalCluster
from trainmover.runtime.config import JobConfig
from trainmover.runtime.progress import INTERVAL_S

WAIT_S = 600.0
MODES = ("machines", "trainmover", "sharded", "tcpstore")
#: Shards of the job's store in the `sharded` mode.
SHARDS = 2
MODE_NAMES = {
    "machines": "TrainMover, a voter per machine",
    "trainmover": "TrainMover, a voter per rank",
    "sharded": f"TrainMover, a voter per rank, {SHARDS} store shards",
    "tcpstore": "bare TCPStore, a voter per rank",
}
#: Votes of a round's start left out (processes starting at different times).
WARMUP = 5
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
    parser.add_argument("--steps", type=int, default=200, help="votes per round (default 200)")
    parser.add_argument(
        "--local-ranks",
        type=int,
        default=4,
        help="ranks per machine of the per-machine vote (default 4; divides every size)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode and size")
    parser.add_argument(
        "--job-steps", type=int, default=200, help="steps of the job measured in (d) (200)"
    )
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


class _Host:
    """A helper process hosting the job's store or machine stores (`store_worker host`)."""

    def __init__(self, what: str):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "trainmover.bench.store_worker", "host", what],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self._proc.stdout is not None
        self.addresses = json.loads(self._proc.stdout.readline())

    def close(self) -> list[tuple[float, float]]:
        """Stops it; its CPU time sampled while it ran: (time.monotonic(), seconds)."""
        out, _ = self._proc.communicate(timeout=WAIT_S)
        if self._proc.returncode != 0:
            raise RuntimeError(f"a store host exited with code {self._proc.returncode}")
        return [(t, cpu) for t, cpu in json.loads(out)]


def _cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds used between two instants, interpolated between samples."""
    times = [t for t, _ in samples]
    cpu = [c for _, c in samples]
    return float(np.interp(end, times, cpu) - np.interp(start, times, cpu))


Samples = list[tuple[float, float]]


def _ranks(
    mode: str,
    world: int,
    arg: float,
    local: int,
    folded: bool,
    voters: int | None = None,
    more: tuple[str, ...] = (),
) -> tuple[list[list[tuple[float, float]]], Samples, Samples]:
    """`world` store_worker processes of `mode` on a fresh job store (and, `folded`, a
    store per machine of `local` ranks); `voters` is their WORLD argument where it is
    not `world`, `more` their last arguments. Returns each one's spans (`WARMUP` left out of a vote round's), and the
    job's and the machines' store hosts' CPU samples."""
    job = _Host(f"job:{SHARDS}" if mode == "sharded" else "job")
    machines = _Host(str(world // local)) if folded else None
    procs: list[subprocess.Popen[str]] = []
    try:
        extra: list[list[str]] = [[] for _ in range(world)]
        if machines is not None:
            extra = [[machines.addresses[rank // local], str(local)] for rank in range(world)]
        # Files, not pipes: a worker's stderr is read only once the workers before it ended.
        errs = [tempfile.TemporaryFile("w+") for _ in range(world)]
        procs += [
            subprocess.Popen(
                [sys.executable, "-m", "trainmover.bench.store_worker", job.addresses,
                 str(rank), str(voters or world), mode, str(arg), *extra[rank], *more],
                stdout=subprocess.PIPE, stderr=errs[rank], text=True,
            )
            for rank in range(world)
        ]  # fmt: skip
        spans: list[list[tuple[float, float]]] = []
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=WAIT_S)
            if proc.returncode != 0:
                errs[rank].seek(0)
                raise RuntimeError(
                    f"the {mode} worker of rank {rank} exited with code {proc.returncode}:\n"
                    + errs[rank].read()[-2000:]
                )
            spans.append([(a, b) for a, b in json.loads(out)[0 if mode == "board" else WARMUP :]])
    finally:
        for proc in procs:
            if proc.poll() is None:  # the round failed: its other workers go with it
                proc.kill()
                proc.wait()
        job_samples = job.close()
        machine_samples = machines.close() if machines is not None else []
    return spans, job_samples, machine_samples


def _round(mode: str, world: int, steps: int, local: int) -> tuple[list[float], float, float]:
    """One round: `world` processes voting `steps` times on a fresh job store. Returns the
    votes' seconds, the job's store's CPU seconds per step, and each machine store's."""
    spans, job_samples, machine_samples = _ranks(mode, world, steps, local, mode == "machines")
    # The steady votes: from the first of them to start to the last to end.
    start = min(s[0][0] for s in spans)
    end = max(s[-1][1] for s in spans)
    voted = steps - WARMUP
    job_cpu = _cpu_between(job_samples, start, end) / voted
    machine_cpu = (
        _cpu_between(machine_samples, start, end) / voted / (world // local)
        if machine_samples
        else 0.0
    )
    return [b - a for s in spans for a, b in s], job_cpu, machine_cpu


#: Seconds the progress board's beacons run in (c).
BOARD_S = 5.0


def _idle_cpu_per_s() -> float:
    """The job store's host's own CPU per second with no client: its sampler, and what
    an idle server costs."""
    job = _Host("job")
    time.sleep(BOARD_S)
    samples = job.close()
    t0, c0 = samples[len(samples) // 10]  # its start-up left out
    t1, c1 = samples[-1]
    return (c1 - c0) / (t1 - t0)


def _board(world: int, local: int, per_voter_ms: float) -> dict[str, Any]:
    """(c) The progress board: `world` ranks' beacons for BOARD_S seconds, each rank's
    entry written to the job's store, then folded per machine of `local` ranks. Per
    way: the job's store's CPU per second above its idle host's. Projected to
    PROJECTED_RANKS: the entries written per second (ranks or machines, at the beacons'
    rate) times a request's CPU as calibrated (a board write is one request; measured
    here, a write of a beacon every 250 ms also wakes an idle server)."""
    idle = _idle_cpu_per_s()
    out: dict[str, Any] = {"ranks": world, "local_ranks": local, "idle_ms_per_s": 1e3 * idle}
    for way, folded in (("per_rank", False), ("per_machine", True)):
        spans, samples, _ = _ranks("board", world, BOARD_S, local, folded)
        start, end = max(s[0][0] for s in spans), min(s[0][1] for s in spans)
        cpu_per_s = _cpu_between(samples, start, end) / (end - start) - idle
        out[way] = {
            "store_cpu_ms_per_s": 1e3 * cpu_per_s,
            "writes_per_s": (world // local if folded else world) / INTERVAL_S,
        }
    entries = {"per_rank": PROJECTED_RANKS, "per_machine": PROJECTED_RANKS // PROJECTED_LOCAL}
    out["at_1024_writes_per_s"] = {way: n / INTERVAL_S for way, n in entries.items()}
    out["at_1024_ms_per_s"] = {
        way: per_voter_ms / VOTER_REQUESTS * n / INTERVAL_S for way, n in entries.items()
    }
    return out


#: Clients that play voters at once (the store kept busy, as a large job keeps it), and
#: the voters each one plays per step.
CALIBRATE_CLIENTS, CALIBRATE_VOTERS = 4, 4


def _calibrate(steps: int) -> float:
    """The job store's CPU per voter and step (ms) with clients playing the voters'
    requests (`store_worker.calibrate_votes`) at once: the store's own cost of a voter,
    which grows a real job's vote with its voters, without this host's contention. One
    client alone would leave the server idle between its requests, and on this VM
    waking an idle server costs more than the request itself (about 25 us of CPU per
    request from idle, 10 us back to back)."""
    spans, samples, _ = _ranks(
        "calibrate",
        CALIBRATE_CLIENTS,
        steps,
        1,
        False,
        voters=CALIBRATE_VOTERS,
        more=(str(CALIBRATE_CLIENTS),),
    )
    start, end = max(s[0][0] for s in spans), min(s[-1][1] for s in spans)
    if end <= start:
        raise RuntimeError("the calibrating clients never played at the same time")
    played = sum(1 for s in spans for a, b in s if a >= start and b <= end)
    return 1e3 * _cpu_between(samples, start, end) / played / CALIBRATE_VOTERS


def _voters(mode: str, world: int, local: int) -> int:
    return world // local if mode == "machines" else world


def _votes(args: argparse.Namespace, progress: Progress) -> list[dict[str, Any]]:
    """Per world size and mode: the median vote (ms), its spread (`<mode>_vote`), the
    voters in the job's store and its CPU per step (`<mode>_store_cpu_ms`); for the
    per-machine vote, each machine store's CPU per step too."""
    sizes = [int(n) for n in args.ranks.split(",")]
    if any(n % args.local_ranks for n in sizes):
        raise SystemExit(f"--local-ranks {args.local_ranks} must divide every size in --ranks")
    samples: dict[tuple[str, int], list[float]] = {(m, n): [] for m in MODES for n in sizes}
    cpu: dict[tuple[str, int], list[float]] = {(m, n): [] for m in MODES for n in sizes}
    machine_cpu: dict[tuple[str, int], list[float]] = {(m, n): [] for m in MODES for n in sizes}
    for _ in range(args.rounds):
        for world in sizes:
            for mode in MODES:  # side by side: alternating in one run
                seconds, store_cpu, local_cpu = _round(mode, world, args.steps, args.local_ranks)
                samples[(mode, world)] += seconds
                cpu[(mode, world)].append(store_cpu)
                machine_cpu[(mode, world)].append(local_cpu)
                median_ms = 1e3 * statistics.median(samples[(mode, world)])
                progress.step(f"{MODE_NAMES[mode]} at {world} ranks: median {median_ms:.2f} ms")
    rows = []
    for world in sizes:
        row: dict[str, Any] = {"ranks": world}
        for mode in MODES:
            ms = [1e3 * v for v in samples[(mode, world)]]
            row[f"{mode}_vote_ms"] = statistics.median(ms)
            row[f"{mode}_vote"] = summary(ms)
            row[f"{mode}_voters"] = _voters(mode, world, args.local_ranks)
            row[f"{mode}_store_cpu_ms"] = 1e3 * statistics.median(cpu[(mode, world)])
        row["machines_machine_store_cpu_ms"] = 1e3 * statistics.median(
            machine_cpu[("machines", world)]
        )
        row["ratio"] = ratio(row["trainmover_vote_ms"], row["tcpstore_vote_ms"])
        row["machines_ratio"] = ratio(row["machines_vote_ms"], row["trainmover_vote_ms"])
        rows.append(row)
    return rows


def main(args: argparse.Namespace) -> int:
    sizes = args.ranks.split(",")
    progress = Progress("store", args.kills + args.rounds * len(sizes) * len(MODES) + 4)
    losses = asyncio.run(_losses(args, progress))
    votes = _votes(args, progress)
    step_ms = 1e3 * losses["median_step_s"]
    per_voter_ms = _calibrate(args.steps)
    progress.step(f"the job's store: {1e3 * per_voter_ms:.1f} us of CPU per voter and step")
    board = _board(votes[-1]["ranks"], args.local_ranks, per_voter_ms)
    progress.step(
        f"the progress board at {board['ranks']} ranks: the job's store "
        f"{board['per_rank']['store_cpu_ms_per_s']:.1f} ms of CPU per second per rank, "
        f"{board['per_machine']['store_cpu_ms_per_s']:.1f} folded per machine"
    )
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-store-"))
    in_jobs = []
    for shards, name in ((0, "in-job"), (SHARDS, "in-job-sharded")):  # one after the other
        ran = store_job.run(
            votes[-1]["ranks"], args.local_ranks, args.job_steps, run_dir / name, progress, shards
        )
        progress.step(
            f"the reference job at {ran['ranks']} ranks, {shards} store shards: vote "
            f"{ran['vote_ms']:.2f} ms of its {ran['median_step_ms']:.1f} ms step "
            f"({100 * ran['share_of_step']:.1f}%)"
        )
        in_jobs.append(ran)
    in_job, in_job_sharded = in_jobs
    # The flat reading does not fit a vote over shards (`with_shards` is its projection).
    projection = {m: store_projection.flat(votes, m, per_voter_ms) for m in MODES if m != "sharded"}
    with_shards = store_projection.sharded(votes, per_voter_ms)
    for row in votes:
        for mode in MODES:
            row[f"{mode}_share_of_step"] = row[f"{mode}_vote_ms"] / step_ms
    result = Result(
        "store", kills=args.kills, ranks=args.ranks, steps=args.steps, local_ranks=args.local_ranks
    )
    result.set("loss", losses)
    result.set("votes", votes)
    result.set("projection", projection)
    result.set("projection_sharded", with_shards)
    result.set("board", board)
    result.set("in_job", in_job)
    result.set("in_job_sharded", in_job_sharded)
    # The runtime votes per machine wherever a machine has several ranks.
    largest, projected = votes[-1], projection["machines"]
    result.set(
        "goals",
        {
            "lost_s_max": losses["lost_s_max"],
            "lost_met": losses["lost_s_max"] <= 2.0,
            "vote_share_at_largest": largest["machines_share_of_step"],
            "vote_share_met": largest["machines_share_of_step"] <= 0.05,
            "vote_share_in_job": in_job["share_of_step"],
            "vote_share_in_job_met": in_job["share_of_step"] <= 0.05,
            "projected_share_at_1024": projected["at_1024_ms"] / step_ms,
            "projected_share_at_1024_sharded": with_shards["at_1024_ms"] / step_ms,
            "projected_met": with_shards["at_1024_ms"] / step_ms <= 0.10,
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
        ["ranks", *(f"{MODE_NAMES[m]}: vote ms (store CPU ms)" for m in MODES),
         "per machine / per rank", "share of step"],
        [
            [r["ranks"],
             *(f"{r[f'{m}_vote_ms']:.3f} ({r[f'{m}_store_cpu_ms']:.3f})" for m in MODES),
             r["machines_ratio"], r["machines_share_of_step"]]
            for r in votes
        ],
    )  # fmt: skip
    lines = [
        f"{MODE_NAMES[m]}: {p['at_1024_ms']:.1f} ms at {PROJECTED_RANKS} ranks "
        f"({p['voters_at_1024']} voters x {p['store_cpu_ms_per_voter']:.4f} ms of store CPU), "
        f"{100 * p['at_1024_ms'] / step_ms:.1f}% of the job's median step "
        f"(wall-time fit on this host: {p['wall_fit_at_1024_ms']:.1f} ms)"
        for m, p in projection.items()
    ]
    lines.append(
        f"{MODE_NAMES['machines']}, {with_shards['shards_at_1024']} store shards: "
        f"{with_shards['at_1024_ms']:.1f} ms at {PROJECTED_RANKS} ranks "
        f"({with_shards['serial_requests_at_1024']} requests on its busiest path against "
        f"{with_shards['flat_requests_at_1024']} without shards; the shards' level "
        f"{with_shards['level_ms']:.3f} ms at {votes[0]['ranks']} ranks), "
        f"{100 * with_shards['at_1024_ms'] / step_ms:.1f}% of the job's median step"
    )
    lines += [
        f"progress board, {way.replace('_', ' ')}: {board[way]['store_cpu_ms_per_s']:.1f} ms "
        f"of the job's store's CPU per second at {board['ranks']} ranks (above its idle "
        f"host's {board['idle_ms_per_s']:.1f}); at {PROJECTED_RANKS} ranks "
        f"{board['at_1024_writes_per_s'][way]:.0f} writes per second, "
        f"{board['at_1024_ms_per_s'][way]:.0f} ms of its CPU per second"
        for way in ("per_rank", "per_machine")
    ]
    lines += [
        f"in the reference job at {j['ranks']} ranks ({j['local_ranks']} per machine, "
        f"{j['shards']} store shards): the vote {j['vote_ms']:.3f} ms (median over "
        f"{j['steps']} steps of the smallest vote over the machines), "
        f"{100 * j['share_of_step']:.1f}% of its {j['median_step_ms']:.1f} ms median step"
        for j in in_jobs
    ]
    text = f"{loss_table}\n\n{vote_table}\n\nprojected:\n" + "\n".join(lines) + "\n"
    md, png = outputs(path)
    md.write_text(text)
    plot.lines(
        png,
        "Per-step commit vote vs ranks (loopback)",
        [r["ranks"] for r in votes],
        {MODE_NAMES[m]: [r[f"{m}_vote"] for r in votes] for m in MODES},
        "ranks",
        "ms per vote",
    )
    print(text)
    fine = all(r["new_incarnation"] and not r["failures_declared"] for r in losses["rows"])
    return 0 if fine else 1
