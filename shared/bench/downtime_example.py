"""``trainmover bench downtime --example NAME``: an example of examples/ (a standard
PyTorch script) under TrainMover against the very same script launched by plain torchrun.

In one invocation, repetitions alternating between the systems: TrainMover's planned
migration (a drain through the client: a warm standby takes over the machine of DP rank
0) and failure (that machine's sidecar and workers SIGKILLed mid-step, detected by the
system), through the services (`"control_plane": "services"`), then checkpoint-restart of the torchrun script (SIGKILL restarted
by torch.distributed.elastic; save-and-restart). The wrapper's cost comes from the same
runs: the steady step period of each system before its events (`step_time.*`), and the
CPU seconds its rank processes spend per step (`step_cpu.*`, `trainmover.bench.cpu`):
the work each system adds, apart from the time its ranks wait for a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from trainmover.bench import ckpt_restart, cpu, downtime
from trainmover.bench.example_jobs import EXAMPLES, example_config
from trainmover.bench.report import (
    Progress,
    Result,
    attempt,
    fmt_stats,
    markdown_table,
    outputs,
)
from trainmover.bench.services_runs import ServicesJob


def run(args: argparse.Namespace) -> Result:
    ex = EXAMPLES[args.example]
    config = example_config(args.example, args.layout, args.tiny)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix=f"trainmover-bench-{args.example}-"))
    result = Result(
        "downtime",
        example=args.example,
        layout=config.layout.model_dump(),
        model=config.model.model_dump(),
        repeats=args.repeats,
        checkpoint_every=args.every,
        warm_steps=args.warm_steps,
        run_dir=str(run_dir),
    )
    progress = Progress(f"downtime --example {args.example}", args.repeats * 4)
    rows: dict[str, list[Any]] = {}

    def record(name: str, what: str, out: Any) -> None:
        rows.setdefault(name, []).append(out)
        progress.step(f"{what}: {_short(out)}")

    progress.note(f"starting TrainMover's job ({config.layout.machines} machines) in {run_dir}")
    window = max(2, args.every - 2)  # steps between two of the baseline's checkpoints
    with ServicesJob(config, run_dir / "trainmover", entry=ex.entry) as tm:
        for rep in range(args.repeats):
            tm.release()
            for kind, event in (("planned", tm.planned), ("failure", tm.failure)):
                steady = tm.settle(args.warm_steps)
                if kind == "planned":
                    ranks = cpu.ranks_matching(FORKSERVER, parent_marker=FORKSERVER)
                    rows.setdefault("step_cpu.trainmover", []).append(
                        cpu.cpu_per_step(
                            ranks, tm.current_step, tm.wait_step, tm.step_stamps, window
                        )
                    )
                record(f"trainmover.{kind}", f"rep {rep + 1} trainmover {kind}",
                       attempt(partial(event, steady)))  # fmt: skip
            tm.settle(0)
            tm.hold()  # idle while the baseline trains
            with ckpt_restart.TorchrunJob(
                config, run_dir / f"torchrun-{rep}", args.every, script=ex.script
            ) as ck:
                ck.launch()
                rows.setdefault("step_cpu.torchrun", []).append(
                    _torchrun_cpu(ck, ex.script, args.every, args.warm_steps, window)
                )
                for kind in ("failure", "planned"):
                    fn = ck.failure if kind == "failure" else ck.planned
                    record(f"checkpoint_restart.{kind}",
                           f"rep {rep + 1} checkpoint-restart {kind}",
                           attempt(partial(fn, args.warm_steps)))  # fmt: skip
    summarize(result, rows)
    return result


#: What the command line of every rank process under TrainMover, and of its parent (the
#: machine's fork server), contains.
FORKSERVER = "trainmover.runtime.forkserver"


def _torchrun_cpu(
    ck: ckpt_restart.TorchrunJob, script: str, every: int, warm_steps: int, window: int
) -> float | None:
    """The baseline's CPU per step between two of its checkpoints (a save is work the
    TrainMover side does not do), after `warm_steps`."""
    start = ck.current_step() + warm_steps
    first = start + (-start) % every + 1  # the step after a checkpoint's
    ck.wait_step(first - 1)
    ranks = cpu.ranks_matching(script, parent_marker="torch.distributed.run")
    return cpu.cpu_per_step(ranks, ck.current_step, ck.wait_step, ck.ends, window, first)


def _short(out: Any) -> str:
    if isinstance(out, dict):
        return f"downtime {out['downtime_s']:.3f} s, step {out['normal_step_s']:.3f} s"
    return str(out)


#: Where each system's steady step period is measured: the windows before its events.
STEP_WINDOWS = {
    "trainmover": ("trainmover.planned", "trainmover.failure"),
    "torchrun": ("checkpoint_restart.failure", "checkpoint_restart.planned"),
}


def summarize(result: Result, rows: dict[str, list[Any]]) -> None:
    """The downtime keys of `bench downtime` (TrainMover's planned and failure,
    checkpoint-restart's, their ratios), and the wrapper's cost: each system's steady
    step period and TrainMover's overhead over torchrun's (`step_time.overhead`, a
    fraction: the median over repetitions of their ratio minus 1)."""
    downtime.summarize(result, rows, [], variants={"trainmover.planned": "trainmover"})
    result.data["unavailable"]["torchft.failure_downtime_s"] = "not run for examples"
    reps = max((len(v) for v in rows.values()), default=0)
    # Per repetition, each system's steady step (median of its windows in that
    # repetition): the two run minutes apart, and the shared cores' load drifts more
    # than that between repetitions, so the overhead is taken within each one.
    per_rep: dict[str, list[float | None]] = {}
    for system, keys in STEP_WINDOWS.items():
        per_rep[system] = []
        for i in range(reps):
            found = [rows[k][i]["normal_step_s"] for k in keys
                     if i < len(rows.get(k, [])) and isinstance(rows[k][i], dict)]  # fmt: skip
            per_rep[system].append(statistics.median(found) if found else None)
        result.set_median(f"step_time.{system}_s", [v for v in per_rep[system] if v is not None])
    overheads = [
        tm / tr - 1.0
        for tm, tr in zip(per_rep["trainmover"], per_rep["torchrun"], strict=True)
        if tm is not None and tr
    ]
    result.set_median("step_time.overhead", overheads, "no repetition measured both systems")
    # The same for the CPU the rank processes spend per step (`trainmover.bench.cpu`).
    cpu_rows = {system: rows.get(f"step_cpu.{system}", []) for system in ("trainmover", "torchrun")}
    for system, values in cpu_rows.items():
        result.set_median(f"step_cpu.{system}_s", [v for v in values if v is not None])
    cpu_overheads = [
        tm / tr - 1.0
        for tm, tr in zip(cpu_rows["trainmover"], cpu_rows["torchrun"], strict=False)
        if tm is not None and tr
    ]
    result.set_median("step_cpu.overhead", cpu_overheads, "no repetition measured both systems")


def table(result: Result) -> str:
    g = result.get
    out = f"examples/{g('example')}: downtime in seconds, median (min–max)\n\n"
    out += markdown_table(
        ["system", "planned", "failure"],
        [
            ["TrainMover", fmt_stats(g("trainmover.planned_downtime_stats")),
             fmt_stats(g("trainmover.failure_downtime_stats"))],
            ["checkpoint-restart (plain torchrun)",
             fmt_stats(g("checkpoint_restart.planned_downtime_stats")),
             fmt_stats(g("checkpoint_restart.failure_downtime_stats"))],
        ],
    )  # fmt: skip
    out += "\n" + markdown_table(
        ["ratio", "value"],
        [[k, g(f"ratio.{k}")] for k in ("planned", "planned_conservative", "failure")],
    )
    out += "\nSteady step period, s, and TrainMover's overhead within each repetition "
    out += "(fraction), median (min–max)\n\n" + markdown_table(
        ["under TrainMover", "under plain torchrun", "TrainMover slower by"],
        [[fmt_stats(g("step_time.trainmover_stats")), fmt_stats(g("step_time.torchrun_stats")),
          fmt_stats(g("step_time.overhead_stats"))]],
    )  # fmt: skip
    out += "\nCPU seconds of the rank processes per step (all ranks), and TrainMover's "
    out += "overhead within each repetition, median (min–max)\n\n" + markdown_table(
        ["under TrainMover", "under plain torchrun", "TrainMover more by"],
        [[fmt_stats(g("step_cpu.trainmover_stats")), fmt_stats(g("step_cpu.torchrun_stats")),
          fmt_stats(g("step_cpu.overhead_stats"))]],
    )  # fmt: skip
    for key, title in (
        ("trainmover.phases_s", "TrainMover planned phases"),
        ("trainmover.failure_phases_s", "TrainMover failure phases"),
        ("checkpoint_restart.planned_phases_s", "Checkpoint-restart planned phases"),
        ("checkpoint_restart.failure_phases_s", "Checkpoint-restart failure phases"),
    ):
        phases = g(key) or {}
        if phases:
            out += f"\n{title} (median s)\n\n" + markdown_table(
                list(phases), [[phases[p] for p in phases]]
            )
    if result.data["unavailable"]:
        out += "\nNot measured\n\n" + markdown_table(
            ["key", "reason"], [[k, v] for k, v in result.data["unavailable"].items()]
        )
    return out


def write(result: Result, json_path: Path) -> None:
    md, _ = outputs(json_path)
    result.write(json_path)
    md.write_text(table(result))


def main(args: argparse.Namespace) -> int:
    result = run(args)
    write(result, args.json)
    print(table(result))
    return 0
