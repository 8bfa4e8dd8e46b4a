"""Benchmark of migration (not a test): planned and unplanned downtime and their phases,
delta vs full rebuild, warm vs cold joiners, the commit agreement's per-step cost.

    python -m trainmover.runtime.bench --json bench.json [--repeats 3] [--config job.yaml]

Failures (issue 5) come first, on the machines the job starts with: each is SIGKILLed
mid-step by the test-only fault hook at a chosen step and point, detected by the harness
(its control connection closes), and recovered from its DP replica onto a standby.
Failure downtime is measured twice: from the kill to the end of the first step done
after the recovery (the in-flight step re-executed), and the glossary's way (docs/glossary.md: end of the
last committed step to the end of the next one, minus a normal step), with its phases:
detect (kill -> noticed), recover (plan sent -> every rank restored: groups rebuilt,
state transferred), first step (restored -> that step done everywhere).

Runs the reference job (TP2 x PP2 x DP2 by default) on loopback and migrates the
machine serving cell (dp 0, pp 0) again and again to a fresh standby, alternating a
delta plan (only the leaver's groups) and a full plan (every group of the job, the
baseline). Each migration commits `margin` steps past the furthest rank once phase 1 is
ready, without holding training, as the executor would.

Downtime follows docs/glossary.md: from the end of the last step before the switch (step k, the
last rank to finish it) to the end of the first step after it (k + 1, last rank), minus
one normal step (the median step period before the event). Phases: prepare (phase 1,
off the critical path), commit (control round trip), transfer (leaver -> joiner state),
first step (joiner restored -> step k + 1 done everywhere).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from trainmover.localjob import LocalJob
from trainmover.runtime import control as c
from trainmover.runtime.config import JobConfig, load_config
from trainmover.runtime.layout import MachineRole
from trainmover.runtime.plan import RankRef
from trainmover.runtime.reports import MigrationReport, RecoveryReport

CELL = MachineRole(dp=0, pp=0)
#: (machine, step, point): failures injected at the start of the run, one per standby.
FAILURES = [("m0", 20, "forward"), ("m3", 32, "backward"), ("m1", 44, "dp-allreduce")]


def _step_end(job: LocalJob, step: int) -> float:
    """When the last rank finished `step`."""
    return max(e.t_end for e in job.steps[step].values())


def _normal_step(job: LocalJob, first: int, last: int) -> float:
    periods = [_step_end(job, s) - _step_end(job, s - 1) for s in range(first + 1, last + 1)]
    return statistics.median(periods)


def measure(job: LocalJob, report: MigrationReport, steady_from: int, steady_to: int) -> dict:
    k = report.commit_step
    job.wait_step(k + 1)
    normal = _normal_step(job, steady_from, steady_to)
    before, after = _step_end(job, k), _step_end(job, k + 1)
    joiners = [e for e in report.switched.values() if e.part == "joiner"]
    leavers = [e for e in report.switched.values() if e.part == "leaver"]
    restored = max(e.t_end for e in joiners)
    return {
        "mode": "full" if len(report.plan.groups) == len(job.layout.all_groups()) else "delta",
        "plan_id": report.plan.plan_id,
        "commit_step": k,
        "groups_rebuilt": len(report.plan.groups),
        "ranks_involved": len(report.switched),
        "normal_step_s": normal,
        "downtime_s": after - before - normal,
        "phases_s": {
            "prepare": report.ready_at - report.prepare_sent,
            "commit": report.commit_acked - report.commit_sent,
            "transfer": restored - min(e.t_start for e in leavers),
            "first_step": after - restored,
        },
        "group_build_s": max(r.build_s for r in report.ready.values()),
        "transfer_bytes_per_rank": max(e.transfer_bytes for e in joiners),
    }


def measure_failure(job: LocalJob, report: RecoveryReport, killed_at: float, normal: float) -> dict:
    s = report.step
    job.wait_step(s + 1)
    before, after = _step_end(job, s), _step_end(job, s + 1)
    restored = max(e.t_end for e in report.switched.values())
    joiner = next(e for e in report.switched.values() if e.part == "joiner")
    return {
        "dead": report.dead,
        "resumed_from_step": s,
        "kill_to_first_step_s": after - killed_at,
        "downtime_s": after - before - normal,
        "normal_step_s": normal,
        "phases_s": {
            "detect": report.detected_at - killed_at,
            "recover": restored - report.recover_sent,
            "group_build": max(e.build_s for e in report.switched.values()),
            "transfer": joiner.transfer_s,
            "first_step": after - restored,
        },
        "rebuilt": sorted({g for e in report.switched.values() for g in e.rebuilt}),
        "repaired": sorted({g for e in report.switched.values() for g in e.repaired}),
        "transfer_bytes_per_rank": joiner.transfer_bytes,
    }


def run_failures(job: LocalJob, run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for machine, step, point in FAILURES:
        dead, noticed = job.wait_failure()
        assert dead == machine
        kills = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
        killed_at = next(k["t"] for k in kills if k["step"] == step)
        report = job.recover(dead, detected_at=noticed)
        normal = _normal_step(job, max(2, step - 12), step - 2)
        row = measure_failure(job, report, killed_at, normal)
        row["point"] = point
        rows.append(row)
    return rows


def first_iterations(job: LocalJob, report: MigrationReport) -> float:
    """The joiner's first real iteration (step k + 1), slowest of its ranks."""
    k = report.commit_step
    job.wait_step(k + 1)
    joiners = report.plan.joiners()
    return max(e.seconds for r, e in job.steps[k + 1].items() if r.machine in joiners)


def vote_costs(job: LocalJob) -> dict[str, float]:
    """Per-step cost of the commit agreement: every rank's vote time (it includes waiting
    for the slowest rank), and the fastest rank's per step (the last voter: the protocol's
    own round trips, no skew)."""
    per_step = [[e.vote_s for e in by_rank.values()] for by_rank in job.steps.values() if by_rank]
    return {
        "median_vote_s": statistics.median(v for votes in per_step for v in votes),
        "median_last_voter_s": statistics.median(min(votes) for votes in per_step),
        "median_step_s": statistics.median(
            e.seconds for by_rank in job.steps.values() for e in by_rank.values()
        ),
    }


def migrate_cell(
    job: LocalJob,
    warm_steps: int,
    margin: int,
    *,
    warm: bool,
    full: bool = False,
    timeout_s: float | None = None,
) -> tuple[MigrationReport, int, dict[RankRef, c.Warmed] | None]:
    """Migrates the machine serving CELL to the first standby after a steady window;
    with `warm`, the standby runs its shadow iterations first. Returns the report, the
    first step of the steady window, and the standby's warm-up reports."""
    # The job is held while the standby starts (its start-up would disturb the step
    # period), then runs a steady window before the event.
    job.wait_connected(timeout_s)
    steady_from = job.current_step() + 2
    job.set_limit(steady_from + warm_steps + 10 * margin + 50)
    job.wait_step(steady_from + warm_steps, timeout_s=timeout_s)
    leaver = next(m for m, cell in job.assignment.items() if cell == CELL)
    warmed = job.warm(job.standbys[:1], timeout_s=timeout_s) if warm else None
    report = job.migrate({leaver: job.standbys[0]}, margin=margin, full=full, timeout_s=timeout_s)
    job.set_limit(max(job.limit, report.commit_step + 2))
    return report, steady_from, warmed


def next_standby(job: LocalJob) -> None:
    """Holds the job at the next boundary and starts a fresh standby."""
    job.set_limit(job.current_step() + 1)
    job.add_standbys(1)


def run_compiled(
    config: JobConfig, repeats: int, margin: int, warm_steps: int, run_dir: Path
) -> dict[str, Any]:
    """The joiner's first real iteration with torch.compile (inductor), warmed and cold,
    alternating, `repeats` of each. Every machine compiles into its own inductor cache,
    so a cold joiner really is cold (on one host they would share the kernels on disk).
    DP is 1: compiling costs minutes per rank on a shared CPU, and the compiled graphs of
    a role do not depend on DP (the gradient all-reduce is outside the model)."""
    timeout_s = 3600.0
    config = config.with_updates(
        layout={"dp": 1},
        cluster={"machines": []},
        train={"steps": 1_000_000, "dump_steps": [], "compile": True},
        # A peer that is compiling is silent for minutes: not a failure here.
        runtime={"group_timeout_s": timeout_s, "failure_timeout_s": timeout_s},
    )
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    shadow: list[dict[str, dict[str, list[float]]]] = []
    with LocalJob.launch(
        config,
        run_dir,
        standbys=1,
        limit=warm_steps,
        timeout_s=timeout_s,
        private_compile_caches=True,
    ) as job:
        for i in range(2 * repeats):
            warm = i % 2 == 0
            report, _, warmed = migrate_cell(
                job, warm_steps, margin, warm=warm, timeout_s=timeout_s
            )
            times["warm" if warm else "cold"].append(first_iterations(job, report))
            if warmed:
                # Per rank and role type; the first iteration of a type compiles.
                shadow.append({str(r): w.iteration_s for r, w in warmed.items()})
            if i + 1 < 2 * repeats:
                next_standby(job)
        job.stop_at(job.limit)
    return {
        "layout": config.layout.model_dump(),
        "backend": "inductor",
        "repeats": repeats,
        "first_iteration_s": times,
        "shadow_iteration_s": shadow,
    }


def run(config: JobConfig, repeats: int, margin: int, warm_steps: int, run_dir: Path) -> dict:
    migrations: list[dict[str, Any]] = []
    first_iteration: dict[str, list[float]] = {"warm": [], "cold": []}
    modes = [full for _ in range(repeats) for full in (False, True)]
    # Open-ended: the benchmark holds and ends the job with limits, not a step count.
    config = config.with_updates(train={"steps": 1_000_000, "dump_steps": []})
    faults = ",".join(f"{m}@{step}:{point}" for m, step, point in FAILURES)
    started = time.time()
    with LocalJob.launch(
        config,
        run_dir,
        standbys=len(FAILURES),
        limit=FAILURES[-1][1] + 8,
        timeout_s=600,
        extra_env={"TM_TEST_FAULT": faults},
    ) as job:
        failures = run_failures(job, run_dir)
        job.wait_step(FAILURES[-1][1] + 8)
        agreement = vote_costs(job)
        job.add_standbys(1)
        for i, full in enumerate(modes):
            # Delta migrations alternate a warm joiner (shadow iterations first) and a
            # cold one; the joiner's first real iteration is compared between the two.
            warm = not full and (i // 2) % 2 == 0
            report, steady_from, _ = migrate_cell(job, warm_steps, margin, warm=warm, full=full)
            row = measure(job, report, steady_from, report.commit_step)
            row["joiner_first_iteration_s"] = first_iterations(job, report)
            row["warm_joiner"] = warm
            migrations.append(row)
            if not full:
                first_iteration["warm" if warm else "cold"].append(row["joiner_first_iteration_s"])
            if i + 1 < len(modes):
                next_standby(job)
        job.stop_at(job.limit)
        record_bytes = job.run_dir.joinpath("records")
        records = {p.name: p.stat().st_size for p in record_bytes.iterdir()}
    med = statistics.median
    return {
        "benchmark": "migration",
        "layout": config.layout.model_dump(),
        "model": config.model.model_dump(),
        "repeats": repeats,
        "margin_steps": margin,
        "wall_s": time.time() - started,
        "migrations": migrations,
        "failures": failures,
        "first_iteration_s": first_iteration,
        "commit_agreement": agreement,
        "record_store_bytes": records,
        "summary": {
            **{
                mode: summarize([m for m in migrations if m["mode"] == mode])
                for mode in ("delta", "full")
            },
            "failure": {
                "count": len(failures),
                "kill_to_first_step_s": med(f["kill_to_first_step_s"] for f in failures),
                "downtime_s": med(f["downtime_s"] for f in failures),
                "phases_s": {
                    p: med(f["phases_s"][p] for f in failures) for p in failures[0]["phases_s"]
                },
            },
            "joiner_first_iteration_s": {"eager": medians(first_iteration)},
            "commit_agreement": agreement,
            "record_store_bytes": sum(records.values()),
        },
    }


def medians(samples: dict[str, list[float]]) -> dict[str, float | None]:
    return {k: statistics.median(v) if v else None for k, v in samples.items()}


def summarize(rows: list[dict]) -> dict:
    med = statistics.median
    return {
        "count": len(rows),
        "downtime_s": med(r["downtime_s"] for r in rows),
        "normal_step_s": med(r["normal_step_s"] for r in rows),
        "group_build_s": med(r["group_build_s"] for r in rows),
        "groups_rebuilt": med(r["groups_rebuilt"] for r in rows),
        "phases_s": {p: med(r["phases_s"][p] for r in rows) for p in rows[0]["phases_s"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, type=Path, help="where to write results")
    parser.add_argument("--config", type=Path, help="job config (YAML/JSON); default TP2xPP2xDP2")
    parser.add_argument("--repeats", type=int, default=3, help="migrations per mode")
    parser.add_argument("--margin", type=int, default=3, help="commit step = furthest + margin")
    parser.add_argument("--warm-steps", type=int, default=10, help="steady steps before each")
    parser.add_argument("--run-dir", type=Path, help="logs and states (default: a temp dir)")
    parser.add_argument(
        "--compile-repeats",
        type=int,
        default=1,
        help="warm and cold joiners each with torch.compile (0: skip; minutes each on CPU)",
    )
    parser.add_argument(
        "--skip-eager", action="store_true", help="only the torch.compile first iterations"
    )
    args = parser.parse_args(argv)
    config = load_config(args.config) if args.config else JobConfig(job="bench")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-"))
    result: dict[str, Any] = {"benchmark": "migration", "summary": {}}
    if not args.skip_eager:
        result = run(config, args.repeats, args.margin, args.warm_steps, run_dir / "eager")
    if args.compile_repeats:
        compiled = run_compiled(
            config, args.compile_repeats, args.margin, args.warm_steps, run_dir / "compile"
        )
        result["compiled"] = compiled
        first = result["summary"].setdefault("joiner_first_iteration_s", {})
        first["compile"] = medians(compiled["first_iteration_s"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


#: Public names for trainmover.bench (the side-by-side benchmarks of issue 7).
step_end = _step_end
normal_step = _normal_step
