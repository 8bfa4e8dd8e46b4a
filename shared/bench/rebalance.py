"""``trainmover bench rebalance``: the training-time ratio with a planned migration every
P seconds, against the same job without migrations, in one invocation, through the
product path (`"control_plane": "services"`): the whole system of `trainmover up`, each
migration a drain through the client.

The run alternates windows of P seconds without and with a migration (one migration per
window: a migration every P seconds), so a drift of the shared cores' load hits both
kinds alike; one long run of each would compare two different loads. Training-time
ratio = steps completed in the windows with migrations / in those without (useful step
time over wall time, relative to the undisturbed job), pooled over all windows, with
the adjacent pairs' ratios as its spread. Each migration's own cost is also accounted
from inside the run (its downtime plus the stayers' extra step time while phase 1 builds
in the background), which gives a second, less noisy ratio and the projection to one
migration every 600 s. The joiners are warm standbys (they start and run their shadow
iterations before the first window), as in the full system; a drained leaver stays in
maintenance for the rest of the run, so its relaunch as a standby (a torch import and
shadow iterations on these shared cores; another machine in production) falls in no
window.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from trainmover.bench import plot
from trainmover.bench.report import (
    Progress,
    Result,
    fmt_stats,
    markdown_table,
    outputs,
    ratio,
    summary,
)
from trainmover.bench.services_runs import CONTROL_PLANE, ServicesJob
from trainmover.bench.settings import add_job_arguments, config_from_args

#: A drained machine's maintenance: longer than any run, so none returns mid-run.
MAINTENANCE_S = 86_400.0
#: How long after a migration's end its aftermath is counted (the leaver's workers
#: exiting, the joiner's first steps), and how long before it the local step rate is
#: taken: short next to the load's drift over a window, long next to what it measures.
AFTER_S = 10.0
BEFORE_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument("--period", type=float, default=60.0, help="seconds between migrations")
    parser.add_argument(
        "--duration", type=float, default=180.0, help="wall time with (and without) migrations"
    )
    parser.add_argument("--repeats", type=int, default=1, help="repeats of the whole run")
    parser.add_argument("--project", type=float, default=600.0, help="projected period (s)")


def phase1_excess(tm: ServicesJob, stamps: dict[str, float], normal: float) -> tuple[float, float]:
    """The stayers' slowdown while phase 1 ran (the executor's phase1 -> committing): the
    witness's step periods ending in [phase 1 entered, committing entered + one step]
    as (their median / normal step, their summed extra time)."""
    ts = tm.cluster.step_ts[tm.witness]
    start, end = stamps["phase1"], stamps["committing"] + normal
    periods = [ts[s] - ts[s - 1] for s in sorted(ts) if s - 1 in ts and start < ts[s] <= end]
    if not periods:
        return 1.0, 0.0
    return statistics.median(periods) / normal, sum(p - normal for p in periods)


def excess_profile(
    ts: dict[int, float], start: float, end: float, marks: dict[str, float], normal: float
) -> dict[str, float]:
    """Where a window's training time went: for each segment between consecutive `marks`
    (name -> when it begins; the first begins at `start`, the last ends at `end`), the
    witness's step periods ending in it less a normal step each, summed."""
    bounds = sorted(marks.items(), key=lambda kv: kv[1])
    edges = [t for _, t in bounds[1:]] + [end]
    out = {}
    for (name, begin), stop in zip(bounds, edges, strict=True):
        periods = [ts[s] - ts[s - 1] for s in ts if s - 1 in ts and begin < ts[s] <= stop]
        out[name] = sum(p - normal for p in periods)
    return out


def window(tm: ServicesJob, seconds: float, migrate: bool) -> dict[str, Any]:
    """`seconds` of training; with `migrate`, one drain a quarter into it (so its whole
    cost, the leaver's exit included, falls inside the window)."""
    start, steady_from = time.time(), tm.current_step()
    migrations = []
    if migrate:
        time.sleep(max(0.0, start + seconds / 4 - time.time()))
        row = tm.planned(steady_from)
        slowdown, excess = phase1_excess(tm, row["stamps"], row["normal_step_s"])
        migrations.append({"event_id": row["event_id"], "downtime_s": row["downtime_s"],
                           "normal_step_s": row["normal_step_s"], "phase1_slowdown": slowdown,
                           "phase1_excess_s": excess})  # fmt: skip
    time.sleep(max(0.0, start + seconds - time.time()))
    ts = dict(tm.cluster.step_ts[tm.witness])
    out: dict[str, Any] = {"migrations": migrations, "wall_s": seconds,
                           "steps": tm.steps_between(start, start + seconds)}  # fmt: skip
    if migrate:
        stamps = tm.stamps(row["event_id"])  # by now with the migration's end
        begin, done = stamps["phase1"], stamps.get("done", stamps["committing"])
        # Counted locally: every step period from phase 1 to AFTER_S past the end,
        # against the step rate just before (the load's drift over a whole window is
        # larger than what a migration costs).
        before = [
            ts[s] - ts[s - 1] for s in ts if s - 1 in ts and begin - BEFORE_S < ts[s] <= begin
        ]
        local = statistics.median(before) if before else row["normal_step_s"]
        marks = {"phase1": begin, "switch": stamps["committing"], "after": done}
        profile = excess_profile(ts, begin, done + AFTER_S, marks, local)
        migrations[0] |= {"local_step_s": local, "excess_s": profile,
                          "counted_cost_s": sum(profile.values())}  # fmt: skip
    return out


def run(args: argparse.Namespace) -> Result:
    config = config_from_args(args)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-rebalance-"))
    windows = max(1, round(args.duration / args.period)) * args.repeats
    result = Result("rebalance", layout=config.layout.model_dump(), period_s=args.period,
                    duration_s=args.duration, repeats=args.repeats, windows=windows,
                    control_plane=CONTROL_PLANE, run_dir=str(run_dir))  # fmt: skip
    progress = Progress("rebalance", 2 * windows)
    progress.note(f"starting the job with {windows} standbys in {run_dir}")
    runs: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
    # Every standby starts and warms up front, before the first window: a standby
    # starting mid-run would steal the shared cores (in production it is another machine).
    with ServicesJob(config, run_dir, standbys=windows, maintenance_s=MAINTENANCE_S) as tm:
        tm.settle(5)
        for i in range(windows):
            for kind in ("without", "with"):
                out = window(tm, args.period, migrate=kind == "with")
                runs[kind].append(out)
                progress.step(f"window {i + 1} {kind} migration: {out['steps']} steps in "
                              f"{args.period:.0f} s")  # fmt: skip
    summarize(result, runs, args.period, args.project)
    return result


def summarize(result: Result, runs: dict[str, list[dict[str, Any]]], period: float,
              project: float) -> None:  # fmt: skip
    result.set("runs", runs)
    pairs = [w["steps"] / wo["steps"] for w, wo in zip(runs["with"], runs["without"], strict=True)
             if wo["steps"]]  # fmt: skip
    result.set_median("training_time_ratio", pairs, "no window completed")
    # The headline pools every window (less noisy than any one pair).
    result.set("training_time_ratio", ratio(sum(r["steps"] for r in runs["with"]),
                                            sum(r["steps"] for r in runs["without"])),
               "no window completed")  # fmt: skip
    migs = [m for r in runs["with"] for m in r["migrations"]]
    result.set_median("migration.downtime_s", [m["downtime_s"] for m in migs], "no migration ran")
    result.set_median("migration.phase1_excess_s", [m["phase1_excess_s"] for m in migs],
                      "no migration ran")  # fmt: skip
    result.set_median("stayer_phase1_slowdown", [m["phase1_slowdown"] for m in migs],
                      "no migration ran")  # fmt: skip
    cost = None
    if migs:
        cost = statistics.median(max(0.0, m["downtime_s"]) + m["phase1_excess_s"] for m in migs)
    result.set("migration.cost_s", cost, "no migration ran")
    for key, p in (("accounted_ratio", period), (f"projected_ratio_{project:g}s", project)):
        result.set(key, None if cost is None else 1 - cost / p, "no migration ran")
    # Counted around each migration (pooled: every migration's lost time over the
    # windows' wall time), and the noise the pooled window count is up against.
    counted = [m["counted_cost_s"] for m in migs if "counted_cost_s" in m]
    result.set_median("migration.counted_cost_s", counted, "no migration ran")
    pooled = sum(counted) / (len(counted) * period) if counted else None
    result.set("counted_ratio", None if pooled is None else 1 - pooled, "no migration ran")
    result.set(f"projected_counted_ratio_{project:g}s",
               None if pooled is None else 1 - pooled * period / project,
               "no migration ran")  # fmt: skip
    without = [r["steps"] for r in runs["without"]]
    result.set_median("noise.without_window_pairs", [b / a for a, b in zip(without, without[1:],
                      strict=False) if a], "fewer than two windows without a migration")  # fmt: skip


def table(result: Result) -> str:
    g = result.get
    stats = g("training_time_ratio_stats") or summary([])
    rows = [
        ["training-time ratio (steps with / without, pooled)", g("training_time_ratio")],
        ["training-time ratio per window pair", fmt_stats(stats)],
        ["noise: consecutive windows without a migration, ratio",
         fmt_stats(g("noise.without_window_pairs_stats"))],
        [f"counted ratio at {g('period_s'):g} s (1 - time lost around each migration / period)",
         g("counted_ratio")],
        *[[f"projected counted ratio at {k.removeprefix('projected_counted_ratio_')}", v]
          for k, v in result.data.items() if k.startswith("projected_counted_ratio_")],
        ["time lost around a migration (counted), s", fmt_stats(g("migration.counted_cost_stats"))],
        [f"accounted ratio at {g('period_s'):g} s (1 - cost / period)", g("accounted_ratio")],
        *[[f"projected ratio at {k.removeprefix('projected_ratio_')}", v]
          for k, v in result.data.items() if k.startswith("projected_ratio_")],
        ["migration cost (downtime + phase-1 excess), s", g("migration.cost_s")],
        ["downtime per migration, s", fmt_stats(g("migration.downtime_stats"))],
        ["stayers' step time during phase 1 / normal", fmt_stats(g("stayer_phase1_slowdown_stats"))],
    ]  # fmt: skip
    return markdown_table(["measure", "median (min–max)"], rows)


def write(result: Result, json_path: Path) -> None:
    md, png = outputs(json_path)
    result.write(json_path)
    md.write_text(table(result))
    runs = result.get("runs")
    panels = [("steps per window", [
        ("without migrations", summary(r["steps"] for r in runs["without"])),
        (f"migration every {result.get('period_s'):g} s", summary(r["steps"] for r in runs["with"])),
    ])]  # fmt: skip
    plot.bars(png, "Steps completed in the same wall time", panels, "steps")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    write(result, args.json)
    print(table(result))
    return 0
