"""``trainmover bench control-plane``: the control plane at the scale of the users' jobs,
with simulated machines against the real services.

Per size in `--machines` (machines of 8 GPUs), a fresh 3-server JetStream cluster, the
real planner, executor and health-monitor as their own processes, and that many
simulated machines (`simmachine`, hosted many per process by `simhost`) speaking the
sidecar's protocol: heartbeats, step statistics at the job's step rate, and the
executor's commands answered after the workers' own delays (`--switch-ms` for the
switch). Measured at each size (`control_plane_size`): a silenced machine to its
failure event, event to plan, plan to the migration's end for a drain and a failure,
the control plane's part of those (the time no simulated worker was busy), the cluster
state's size and the cost of one update, each process's CPU and memory, the bus's
messages per second, `trainmover status` and the status page. A size that cannot run
(a limit hit, a service that falls over) is recorded as failed with its cause, and the
next size runs.

Writes the JSON, a Markdown table beside it and a plot of the times over the sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from trainmover.bench import plot
from trainmover.bench.control_plane_size import SizeRun, log_cause
from trainmover.bench.report import Progress, Result, fmt_stats, markdown_table, outputs
from trainmover.logs import get_logger

log = get_logger("bench.control-plane")

KINDS = ("drain", "failure")
#: Per migration kind: the times summarised over its repetitions.
TIMES = ("event_to_plan_s", "plan_to_end_s", "control_plane_s", "workers_busy_s")
#: Per size: what a size that failed before measuring them leaves null, with its reason.
SIZE_KEYS = (
    "startup_s", "state_bytes", "state_put_s", "status_cli_s", "status_page_s",
    "bus_in_msgs_per_s", "failure.detect_s",
    *(f"{kind}.{t}" for kind in KINDS for t in TIMES),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, required=True, help="result file (.md, .png beside)")
    parser.add_argument(
        "--machines", default="64,512,2048,8192", help="job sizes in machines of 8 GPUs"
    )
    parser.add_argument("--pp", type=int, default=8, help="pipeline stages (default 8)")
    parser.add_argument("--reps", type=int, default=3, help="drains and failures per size (3)")
    parser.add_argument("--step", type=float, default=1.0, help="the job's step, seconds (1.0)")
    parser.add_argument(
        "--switch-ms", type=float, default=50.0, help="the workers' own switch, ms (50)"
    )
    parser.add_argument(
        "--maintenance", type=float, default=2.0, help="seconds a drained machine stays away"
    )
    parser.add_argument("--window", type=float, default=10.0, help="steady window, seconds")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait, seconds")
    parser.add_argument("--seed", type=int, default=41, help="which machines move")
    parser.add_argument("--run-dir", type=Path, help="logs of every size (default: temporary)")


def _summarise(result: Result, n: int, reason: str | None) -> None:
    """Medians over each kind's repetitions that ended done; nulls with `reason`."""
    prefix = f"sizes.{n}"
    rows = [r for r in result.get(f"{prefix}.migrations") or [] if r.get("end_state") == "done"]
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        why = reason or f"no {kind} ended done"
        for key in TIMES:
            result.set_median(f"{prefix}.{kind}.{key}", [r[key] for r in mine], why)
        counts = sorted(sum(r["commands"].values()) for r in mine)
        result.set(f"{prefix}.{kind}.commands", counts[len(counts) // 2] if counts else None, why)
        if kind == "failure":
            result.set_median(f"{prefix}.failure.detect_s", [r["detect_s"] for r in mine], why)
    for key in SIZE_KEYS:
        if result.get(f"{prefix}.{key}") is None:
            result.set(f"{prefix}.{key}", None, reason or "not measured")


def _ms(value: float | None) -> float | None:
    return None if value is None else 1e3 * value


def _kb(value: float | None) -> float | None:
    return None if value is None else value / 1e3


def tables(result: Result, sizes: list[int]) -> str:
    """The Markdown of a result: times, costs, and the sizes that failed."""
    times, costs, failed = [], [], []
    for n in sizes:
        p = f"sizes.{n}"
        g = result.get
        times.append(
            [f"{n} ({g(f'{p}.gpus')})", fmt_stats(g(f"{p}.failure.detect_stats")),
             *(fmt_stats(g(f"{p}.{k}.event_to_plan_stats")) for k in KINDS),
             *(fmt_stats(g(f"{p}.{k}.plan_to_end_stats")) for k in KINDS),
             *(fmt_stats(g(f"{p}.{k}.control_plane_stats")) for k in KINDS),
             f"{g(f'{p}.drain.commands')} / {g(f'{p}.failure.commands')}",
             g(f"{p}.status_cli_s"), g(f"{p}.status_page_s")]
        )  # fmt: skip
        cores = g(f"{p}.cpu_cores") or {}
        rss = g(f"{p}.rss_mib") or {}
        nats = sum(v for k, v in cores.items() if k.startswith("nats-")) if cores else None
        costs.append(
            [n, _kb(g(f"{p}.state_bytes")), _kb(g(f"{p}.state.whole_bytes")),
             _kb(g(f"{p}.state.largest_value_bytes")), _ms(g(f"{p}.state_put_s")),
             _ms(g(f"{p}.state.encode_s")), _ms(g(f"{p}.state.decode_s")), g(f"{p}.startup_s"),
             *(cores.get(s) for s in ("planner", "executor", "health-monitor")), nats,
             cores.get("status-page"),
             "/".join(f"{rss[s]:.0f}" for s in ("planner", "executor", "health-monitor"))
             if rss else None,
             g(f"{p}.bus_in_msgs_per_s"), len(g(f"{p}.spurious_failures") or [])]
        )  # fmt: skip
        if g(f"{p}.failed"):
            failed.append(f"- {n} machines: {g(f'{p}.failed')}")
    text = "Times (s; median (min-max) over the repetitions):\n\n" + markdown_table(
        ["machines (GPUs)", "silent -> failure event", "drain event -> plan",
         "failure event -> plan", "drain plan -> end", "failure plan -> end",
         "drain control plane", "failure control plane", "commands drain / failure",
         "trainmover status", "status page"],
        times,
    )  # fmt: skip
    text += "\nCosts (CPU in cores over the steady window, memory in MiB):\n\n" + markdown_table(
        ["machines", "state kB", "as one value kB", "largest value kB", "update write ms",
         "update encode ms", "update decode ms", "start-up s",
         "planner CPU", "executor CPU", "health-monitor CPU", "nats CPU (3)", "status page CPU",
         "RSS planner/executor/monitor", "bus msgs/s in", "spurious failures"],
        costs,
    )  # fmt: skip
    if failed:
        text += "\nSizes that failed:\n\n" + "\n".join(failed) + "\n"
    return text


def _plot(result: Result, sizes: list[int], path: Path) -> None:
    ran = [n for n in sizes if result.get(f"sizes.{n}.drain.plan_to_end_s") is not None]
    measured = bool(ran)
    ran = ran or sizes  # an empty plot says so: every series not measured
    series = {
        "silent -> failure event": "failure.detect_stats",
        "failure event -> plan": "failure.event_to_plan_stats",
        "drain plan -> end": "drain.plan_to_end_stats",
        "failure plan -> end": "failure.plan_to_end_stats",
        "drain control plane": "drain.control_plane_stats",
        "failure control plane": "failure.control_plane_stats",
    }
    plot.lines(
        path,
        "Control plane vs job size (simulated machines, real services, 3 NATS servers)",
        [float(n) for n in ran],
        {
            label: [result.get(f"sizes.{n}.{key}") or {} for n in ran]
            for label, key in series.items()
        },
        "machines (8 GPUs each)",
        "seconds",
        log=measured,
    )


def main(args: argparse.Namespace) -> int:
    sizes = [int(n) for n in str(args.machines).split(",")]
    base = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-control-plane-"))
    result = Result(
        "control-plane", machines=sizes, pp=args.pp, reps=args.reps, step_s=args.step,
        switch_ms=args.switch_ms, run_dir=str(base),
    )  # fmt: skip
    progress = Progress("control-plane", len(sizes) * (1 + 2 * args.reps))
    for n in sizes:
        run_dir = base / f"n{n}"
        reason = None
        try:
            asyncio.run(SizeRun(n, args, run_dir, result, progress).run())
        except Exception as err:  # a size that breaks is a result; the next one runs
            cause = log_cause(run_dir / "logs")
            reason = f"{type(err).__name__}: {err}" + (f" ({cause})" if cause else "")
            result.set(f"sizes.{n}.failed", reason)
            log.error("size_failed", machines=n, reason=reason)
            progress.note(f"{n} machines: FAILED: {reason}")
        _summarise(result, n, reason)
    path = result.write(args.json)
    md, png = outputs(path)
    text = tables(result, sizes)
    md.write_text(text)
    _plot(result, sizes, png)
    print(text)
    ran: list[Any] = [n for n in sizes if not result.get(f"sizes.{n}.failed")]
    # A larger size failing is what the benchmark is for; nothing running is not.
    return 0 if ran else 1
