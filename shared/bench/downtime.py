"""``trainmover bench downtime``: downtime of a planned migration and of an unplanned
failure, TrainMover vs its ablations vs checkpoint-restart (torchrun) vs torchft, on the
same job, repetitions alternating between systems in one invocation.

TrainMover's rows (`trainmover.*`, `"control_plane": "services"`) come from the product
path: the whole system of `trainmover up`, a drain through the client and a SIGKILL of
a machine that the system detects by itself (`services_runs`). The runtime floor and
the ablations (`runtime_floor.*`, `ablations.*`, `"control_plane": "runtime"`) drive
the worker runtime alone (`trainmover_runs`): what the protocol costs without the
services' round trips, and what each of its parts saves.

Only one system trains at a time (the others are held or not running), so they do not
steal each other's CPU on these shared cores. Output: --json FILE, FILE.md, FILE.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from trainmover.bench import ckpt_restart, example_jobs, plot, torchft_peer
from trainmover.bench.report import (
    Progress,
    Result,
    attempt,
    first_reason,
    fmt_stats,
    markdown_table,
    outputs,
    ratio,
    successes,
)
from trainmover.bench.services_runs import CONTROL_PLANE, ServicesJob
from trainmover.bench.settings import add_job_arguments, config_from_args, harness_timeout_s
from trainmover.bench.trainmover_runs import VARIANTS, TrainMoverJob

#: JSON key of each planned row kind (raw rows under "runs").
VARIANT_KEYS = {
    "trainmover.planned": "trainmover",
    "runtime.delta": "runtime_floor",
    "runtime.full_rebuild": "ablations.full_rebuild",
    "runtime.no_overlap": "ablations.no_overlap",
    "runtime.no_shadow": "ablations.no_shadow",
}
#: How each summary's rows were driven.
CONTROL_PLANES = {"trainmover": CONTROL_PLANE, "runtime_floor": "runtime", "ablations": "runtime"}


#: The run's description, kept by `resummarize`.
META = ("benchmark", "started", "layout", "model", "compile", "repeats", "checkpoint_every",
        "torchft_timeouts", "run_dir")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per system")
    parser.add_argument("--warm-steps", type=int, default=8, help="steady steps before events")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument(
        "--example",
        choices=sorted(example_jobs.EXAMPLES),
        help="an examples/ script (its own layout, default 1x1x2) against the same script "
        "under plain torchrun, and the wrapper's step-time cost, instead of the reference job",
    )
    parser.add_argument(
        "--torchft-timeouts",
        type=float,
        nargs="*",
        default=[torchft_peer.DEFAULT_HEARTBEAT_TIMEOUT_S, 1.0],
        help="lighthouse heartbeat timeouts to measure torchft at (s); none: skip torchft",
    )


def run(args: argparse.Namespace) -> Result:
    config = config_from_args(args)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-downtime-"))
    result = Result(
        "downtime",
        layout=config.layout.model_dump(),
        model=config.model.model_dump(),
        compile=config.train.compile,
        repeats=args.repeats,
        checkpoint_every=args.every,
        torchft_timeouts=args.torchft_timeouts,
        run_dir=str(run_dir),
    )
    per_rep = 2 + len(VARIANTS) + 2 + len(args.torchft_timeouts)
    progress = Progress("downtime", args.repeats * per_rep)
    rows: dict[str, list[Any]] = {}

    def record(name: str, what: str, out: Any) -> None:
        rows.setdefault(name, []).append(out)
        progress.step(f"{what}: {_short(out)}")

    progress.note(f"starting TrainMover ({config.layout.machines} machines, the services and "
                  f"the runtime floor's job) in {run_dir}")  # fmt: skip
    with (
        ServicesJob(config, run_dir / "trainmover") as tm,
        TrainMoverJob(config, run_dir / "runtime", standbys=1) as floor,
    ):
        for rep in range(args.repeats):
            tm.release()
            for kind, event in (("planned", tm.planned), ("failure", tm.failure)):
                steady = tm.settle(args.warm_steps)
                record(f"trainmover.{kind}", f"rep {rep + 1} trainmover {kind}",
                       attempt(partial(event, steady)))  # fmt: skip
            tm.settle(0)  # the killed machine back as a warm standby before the others run
            tm.hold()
            for variant in VARIANTS:
                steady = floor.settle(args.warm_steps, warm=variant != "no_shadow")
                record(f"runtime.{variant}", f"rep {rep + 1} runtime {variant}",
                       attempt(partial(floor.planned, variant, steady)))  # fmt: skip
            floor.hold()
            # Both TrainMover jobs are held (idle) while the baselines run.
            with ckpt_restart.TorchrunJob(config, run_dir / f"torchrun-{rep}", args.every) as ck:
                progress.note("starting the torchrun job")
                ck.launch()
                for kind in ("failure", "planned"):
                    fn = ck.failure if kind == "failure" else ck.planned
                    record(f"checkpoint_restart.{kind}", f"rep {rep + 1} checkpoint-restart "
                           f"{kind}", attempt(partial(fn, args.warm_steps)))  # fmt: skip
            for hb in args.torchft_timeouts:
                out = attempt(
                    partial(
                        torchft_peer.failure,
                        config,
                        run_dir / f"torchft-{rep}-{hb:g}",
                        hb,
                        args.warm_steps,
                        harness_timeout_s(config),
                    )
                )
                record(f"torchft.hb{hb:g}", f"rep {rep + 1} torchft heartbeat timeout {hb:g} s",
                       out)  # fmt: skip
    summarize(result, rows, args.torchft_timeouts)
    return result


def _short(out: Any) -> str:
    if isinstance(out, dict):
        return f"downtime {out.get('downtime_s', float('nan')):.3f} s"
    return str(out)


def _phase_medians(rows: list[dict[str, Any]], key: str = "phases_s") -> dict[str, float]:
    """Each phase's median over the rows that report it (in first-seen order)."""
    names = list(dict.fromkeys(p for r in rows for p in r[key]))
    return {
        p: statistics.median(r[key][p] for r in rows if r[key].get(p) is not None)
        for p in names
        if any(r[key].get(p) is not None for r in rows)
    }


def _median_of(rows: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in rows if r.get(field) is not None]
    return statistics.median(values) if values else None


def summarize(
    result: Result,
    rows: dict[str, list[Any]],
    timeouts: list[float],
    variants: dict[str, str] = VARIANT_KEYS,
) -> None:
    """The issue's keys from the raw rows (kept under "runs"), for the planned `variants`
    that ran."""
    result.set("runs", rows)
    for key, plane in CONTROL_PLANES.items():
        if any(k == key or k.startswith(key + ".") for k in variants.values()):
            result.set(f"{key}.control_plane", plane)
    for name, key in variants.items():
        values = rows.get(name, [])
        ok = successes(values)
        result.set_median(
            f"{key}.planned_downtime_s", [r["downtime_s"] for r in ok], first_reason(values)
        )
        if ok:
            result.set(f"{key}.phases_s", _phase_medians(ok))
            for field in ("group_build_s", "normal_step_s", "groups_rebuilt",
                          "joiner_first_iteration_s", "witness_gap_s"):  # fmt: skip
                value = _median_of(ok, field)
                if value is not None:
                    result.set(f"{key}.{field}", value)
    fail = rows.get("trainmover.failure", [])
    fail_ok = successes(fail)
    result.set_median(
        "trainmover.failure_downtime_s", [r["downtime_s"] for r in fail_ok], first_reason(fail)
    )
    if fail_ok:
        result.set("trainmover.failure_phases_s", _phase_medians(fail_ok))
        for field in ("end_to_end_s", "lost_in_flight_s"):
            result.set(f"trainmover.failure_{field}", _median_of(fail_ok, field),
                       "not reported")  # fmt: skip
    # Memory: medians over the runtime floor's migrations (its harness samples every
    # worker's RSS).
    mem = [r["memory_mib"] for r in successes(rows.get("runtime.delta", []))]
    for field in mem[0] if mem else ():
        values = [m[field] for m in mem if m[field] is not None]
        result.set(f"memory_mib.{field}", statistics.median(values) if values else None,
                   "not sampled")  # fmt: skip

    for kind in ("planned", "failure"):
        values = rows.get(f"checkpoint_restart.{kind}", [])
        ok = successes(values)
        result.set_median(
            f"checkpoint_restart.{kind}_downtime_s",
            [r["downtime_s"] for r in ok],
            first_reason(values),
        )
        if ok:
            result.set(f"checkpoint_restart.{kind}_phases_s", _phase_medians(ok))
    ck_fail = successes(rows.get("checkpoint_restart.failure", []))
    if ck_fail:
        result.set("checkpoint_restart.failure_end_to_end_s",
                   statistics.median(r["end_to_end_s"] for r in ck_fail))  # fmt: skip
        result.set("checkpoint_restart.recomputed_steps",
                   statistics.median(r["recomputed_steps"] for r in ck_fail))  # fmt: skip

    torchft_peer.summarize(result, rows, timeouts)

    tm_planned = result.get("trainmover.planned_downtime_s")
    tm_fail = result.get("trainmover.failure_downtime_s")
    why_fail = result.data["unavailable"].get("trainmover.failure_downtime_s")
    for key, num, den, why in (
        ("ratio.planned", result.get("checkpoint_restart.planned_downtime_s"), tm_planned, None),
        ("ratio.failure", result.get("checkpoint_restart.failure_downtime_s"), tm_fail, why_fail),
        ("ratio.failure_vs_torchft", result.get("torchft.failure_downtime_s"), tm_fail, why_fail),
    ):
        result.set(key, ratio(num, den), why or "a side is missing or TrainMover's is <= 0")
    # TrainMover's planned downtime is about the step-time noise here and its median can
    # be <= 0; the conservative ratio (baseline's best over TrainMover's worst) stays
    # defined whenever any TrainMover sample is positive.
    tm_stats = result.get("trainmover.planned_downtime_stats") or {}
    ck_stats = result.get("checkpoint_restart.planned_downtime_stats") or {}
    result.set(
        "ratio.planned_conservative",
        ratio(ck_stats.get("min"), tm_stats.get("max")),
        "a side is missing or every TrainMover sample is <= 0",
    )


def write(result: Result, json_path: Path) -> None:
    md, png = outputs(json_path)
    result.write(json_path)
    md.write_text(table(result))
    stats = result.get

    panels = [
        (
            "planned migration",
            [
                ("TrainMover", stats("trainmover.planned_downtime_stats")),
                ("runtime floor", stats("runtime_floor.planned_downtime_stats")),
                ("ablation: full rebuild", stats("ablations.full_rebuild.planned_downtime_stats")),
                ("ablation: no overlap", stats("ablations.no_overlap.planned_downtime_stats")),
                ("ablation: no shadow", stats("ablations.no_shadow.planned_downtime_stats")),
                ("checkpoint-restart", stats("checkpoint_restart.planned_downtime_stats")),
            ],
        ),
        (
            "unplanned failure",
            [
                ("TrainMover", stats("trainmover.failure_downtime_stats")),
                ("checkpoint-restart", stats("checkpoint_restart.failure_downtime_stats")),
                ("torchft survivors' stall", stats("torchft.failure_downtime_stats")),
            ],
        ),
    ]
    panels = [(t, [(label, s or {"median": None}) for label, s in items]) for t, items in panels]
    plot.bars(png, "Downtime per event (median, min–max)", panels, "seconds")


def table(result: Result) -> str:
    g = result.get
    rows = [
        ["TrainMover (through the services)", fmt_stats(g("trainmover.planned_downtime_stats")),
         fmt_stats(g("trainmover.failure_downtime_stats"))],
        ["runtime floor (worker runtime alone)",
         fmt_stats(g("runtime_floor.planned_downtime_stats")), ""],
        ["ablation: full rebuild", fmt_stats(g("ablations.full_rebuild.planned_downtime_stats")), ""],
        ["ablation: no phase-1 overlap", fmt_stats(g("ablations.no_overlap.planned_downtime_stats")), ""],
        ["ablation: no shadow iterations", fmt_stats(g("ablations.no_shadow.planned_downtime_stats")), ""],
        ["checkpoint-restart (torchrun)", fmt_stats(g("checkpoint_restart.planned_downtime_stats")),
         fmt_stats(g("checkpoint_restart.failure_downtime_stats"))],
        ["torchft (survivors' stall, default timeout)", "",
         fmt_stats(g("torchft.failure_downtime_stats"))],
    ]  # fmt: skip
    out = (
        "Downtime in seconds, median (min–max). TrainMover: control plane "
        f"{g('trainmover.control_plane')}; runtime floor and ablations: control plane "
        f"{g('runtime_floor.control_plane')}\n\n"
    )
    out += markdown_table(["system", "planned", "failure"], rows)
    out += "\n" + markdown_table(
        ["ratio", "value"],
        [
            [k, g(f"ratio.{k}")]
            for k in ("planned", "planned_conservative", "failure", "failure_vs_torchft")
        ],
    )
    ft = {k: v for k, v in (g("torchft") or {}).items() if k.startswith("heartbeat_")}
    if ft:
        out += "\ntorchft per lighthouse heartbeat timeout (median (min–max))\n\n"
        out += markdown_table(
            ["heartbeat timeout", "survivors' stall s", "heal s", "reduced-batch steps",
             "lost step equivalents"],
            [[k.removeprefix("heartbeat_"), fmt_stats(v.get("stall_stats")),
              fmt_stats(v.get("heal_stats")), fmt_stats(v.get("reduced_batch_steps_stats")),
              fmt_stats(v.get("lost_steps_equivalent_stats"))] for k, v in ft.items()],
        )  # fmt: skip
    phase_tables = (
        ("checkpoint_restart.planned_phases_s", "Checkpoint-restart planned phases"),
        ("checkpoint_restart.failure_phases_s", "Checkpoint-restart failure phases"),
        ("trainmover.phases_s", "TrainMover planned phases"),
        ("trainmover.failure_phases_s", "TrainMover failure phases"),
        ("runtime_floor.phases_s", "Runtime floor planned phases"),
    )
    for key, title in phase_tables:
        phases = g(key) or {}
        if phases:
            out += f"\n{title} (median s)\n\n" + markdown_table(
                list(phases), [[phases[p] for p in phases]]
            )
    first = [[label, g(f"{key}.joiner_first_iteration_s")] for label, key in
             (("warm (shadow iterations)", "runtime_floor"),
              ("cold (no_shadow)", "ablations.no_shadow"))]  # fmt: skip
    if any(v is not None for _, v in first):
        out += "\nJoiner's first real iteration (median s)\n\n"
        out += markdown_table(["joiner", "s"], first)
    mem = g("memory_mib") or {}
    if mem:
        out += (
            "\nMemory (MiB, RSS, median over the runtime floor's migrations)\n\n"
            + markdown_table(["measure", "MiB"], [[k, v] for k, v in mem.items()])
        )
    if result.data["unavailable"]:
        out += "\nNot measured\n\n" + markdown_table(
            ["key", "reason"], [[k, v] for k, v in result.data["unavailable"].items()]
        )
    return out


def resummarize(json_path: Path) -> Result:
    """Recomputes the summary, table and plot of a finished run from its raw rows (after
    a change to the summary; the measurements are not repeated)."""
    data = json.loads(json_path.read_text())
    result = Result("downtime")
    result.data = {k: v for k, v in data.items() if k in META}
    result.data["unavailable"] = {}
    timeouts = data.get("torchft_timeouts") or [
        float(k.removeprefix("torchft.hb")) for k in data["runs"] if k.startswith("torchft.hb")
    ]
    summarize(result, data["runs"], timeouts)
    result.data["torchft_timeouts"] = timeouts
    write(result, json_path)
    return result


def main(args: argparse.Namespace) -> int:
    result = run(args)
    write(result, args.json)
    print(table(result))
    return 0
