"""``trainmover bench state``: how a migration's downtime and memory grow with the state
a rank carries, from megabytes to gigabytes, beside the link it travels on and beside
checkpoint-restart of the same state.

The job is the reference job at 1 x 1 x 2 (two machines of one rank, each the other's
data-parallel replica) with a tiny model and an untrained block of `size` bytes in every
rank's state (`model.extra_state_bytes`), so that only the state's size changes between
sizes. For each size, one after the other (one system trains at a time on these cores):

- link: raw gloo send/recv of the same bytes between two processes, and the runtime's
  streamed transfer alone between the same two processes (`link_probe`);
- TrainMover, through the services (`services_runs`): `--repeats` drains of the machine
  holding m0's role (planned: the state from the leaver; each drain's joiner is the
  machine the one before drained, back from its maintenance and warm) and then a SIGKILL
  of that machine (failure: the state from the replica m1); downtime from the
  executor's progress; transfer seconds and peak memory from each worker's own log (its
  receive; VmHWM as the transfer starts and once it is over:
  `trainmover.runtime.logs.peak_rss_mib`); the row gives the drains' medians and their
  worst memory overhead;
- the same drains with the per-chunk checksums off (`runtime.transfer_checksum`), to
  tell what the checksums cost from what the streaming costs;
- checkpoint-restart of the same job under torchrun: torch.save to local disk, relaunch,
  torch.load (`ckpt_restart.TorchrunJob.planned`).

Output: --json FILE with `rows` (one per size) and FILE.md, FILE.png beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from trainmover.bench import ckpt_restart, plot
from trainmover.bench.report import Progress, Result, attempt, markdown_table, outputs
from trainmover.bench.services_runs import ServicesJob
from trainmover.bench.settings import bench_config
from trainmover.bench.state_model import project, size_row
from trainmover.runtime.config import JobConfig
from trainmover.runtime.layout import Layout

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEFAULT_SIZES = "16M,256M,1G,4G"
#: What is measured per size, in this order.
SYSTEMS = ("link", "trainmover", "trainmover_no_checksum", "ckpt")


def parse_sizes(text: str) -> list[int]:
    """'16M,1G' -> [16 MiB, 1 GiB] in bytes (K, M, G: binary units; a bare number: bytes)."""
    sizes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        unit = UNITS.get(item[-1].upper())
        number = item[:-1] if unit else item
        try:
            value = float(number) * (unit or 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"size {item!r}: a number with K, M or G") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"size {item!r} must be positive")
        sizes.append(int(value))
    if not sizes:
        raise argparse.ArgumentTypeError("no size given")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", type=Path, required=True, help="result file (.md and .png beside it)"
    )
    parser.add_argument(
        "--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
        help=f"state bytes per rank, comma-separated (default {DEFAULT_SIZES})",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-mib", type=float, default=64.0, help="transfer chunk size (default 64)"
    )
    parser.add_argument(
        "--link-repeats", type=positive, default=5, help="raw gloo transfers per size (default 5)"
    )
    parser.add_argument(
        "--repeats", type=positive, default=3,
        help="planned migrations per size and TrainMover system (medians reported; default 3)",
    )  # fmt: skip
    parser.add_argument("--warm-steps", type=int, default=20, help="steady steps before each event")
    parser.add_argument(
        "--systems", type=parse_systems, default=list(SYSTEMS),
        help=f"which to measure, comma-separated (default all: {','.join(SYSTEMS)})",
    )  # fmt: skip
    parser.add_argument("--run-dir", type=Path, help="logs, checkpoints (default: a temp dir)")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return value


def parse_systems(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown system {unknown[0] if unknown else text!r}: choose from {', '.join(SYSTEMS)}"
        )
    return chosen


def job_config(size: int, chunk_mib: float) -> JobConfig:
    config = bench_config(Layout(tp=1, pp=1, dp=2), tiny=True)
    return config.with_updates(
        model={"extra_state_bytes": size},
        runtime={"transfer_chunk_mib": chunk_mib},
    )


def link(size: int, repeats: int, chunk_mib: float) -> dict[str, Any]:
    """Raw gloo, and the runtime's transfer alone: seconds per transfer of `size` bytes
    between two processes."""
    port = ckpt_restart.free_port()

    def probe(rank: int) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "trainmover.bench.link_probe", "--rank", str(rank),
               "--port", str(port), "--bytes", str(size), "--repeats", str(repeats),
               "--chunk-bytes", str(int(chunk_mib * (1 << 20)) // 8 * 8)]  # fmt: skip
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    sender, receiver = probe(0), probe(1)
    out, _ = receiver.communicate(timeout=900)
    sender.wait(timeout=60)
    if receiver.returncode or sender.returncode:
        raise RuntimeError(f"link probe failed ({sender.returncode}, {receiver.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def trainmover(
    config: JobConfig, run_dir: Path, warm_steps: int, repeats: int, failure: bool = True
) -> dict[str, Any]:
    """`repeats` drains of the machine holding m0's role (each to the machine the one
    before drained, back from its maintenance and warm) and then (`failure`) a SIGKILL
    of that machine, through the whole system."""
    out: dict[str, Any] = {"planned": []}
    with ServicesJob(config, run_dir, standbys=1, maintenance_s=1.0) as tm:
        for i in range(repeats):
            out["planned"].append(tm.planned(tm.settle(warm_steps, returned=i > 0)))
        if failure:
            out["failure"] = tm.failure(tm.settle(warm_steps))
        plans = {p.event_id: p.plan_id for p in tm.progress if p.plan_id}
    measured = [(row, {"commit", "transferring"}) for row in out["planned"]]
    if failure:
        measured.append((out["failure"], {"transferring"}))
    for row, starts in measured:
        row["memory"] = peaks(run_dir / "run", plans[row["event_id"]], starts)
    return out


def peaks(logs: Path, plan_id: str, starts: set[str]) -> dict[str, dict[str, float]]:
    """machine -> its peak memory (MiB) as the plan's transfer started (or at the commit,
        for a rank that sends nothing: `before`) and once the plan was over (`after`), and
        the seconds its own send or receive took (`transfer_s`, from the leaver's first byte)
    and a receiver's wait for that byte (`transfer_wait_s`), from its workers' logs."""
    out: dict[str, dict[str, float]] = {}
    for path in sorted(logs.glob("*/logs/*-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("plan_id") != plan_id or event.get("peak_rss_mib") is None:
                continue
            entry = out.setdefault(event["machine"], {})
            if event["event"] in starts:
                entry.setdefault("before", event["peak_rss_mib"])
                if event["event"] == "transferring":
                    entry["before"] = event["peak_rss_mib"]  # nearer the transfer
            elif event["event"] in ("switched", "recovered"):
                entry["after"] = event["peak_rss_mib"]
                if event.get("transfer_bytes"):
                    entry["transfer_s"] = event["transfer_s"]
                    entry["transfer_wait_s"] = event.get("transfer_wait_s", 0.0)
    return out


def checkpoint_restart(config: JobConfig, run_dir: Path, warm_steps: int) -> dict[str, Any]:
    with ckpt_restart.TorchrunJob(config, run_dir, every=10**9, max_restarts=0) as job:
        job.launch()
        job.wait_step(warm_steps)
        return job.planned(warm_steps)


def run(args: argparse.Namespace) -> Result:
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-state-"))
    result = Result(
        "state", layout="1x1x2", sizes=args.sizes, chunk_mib=args.chunk_mib, run_dir=str(run_dir)
    )
    progress = Progress("state", len(args.systems) * len(args.sizes))
    runs: dict[str, dict[str, Any]] = {}
    for size in args.sizes:
        label = human(size)
        config = job_config(size, args.chunk_mib)
        measured: dict[str, Any] = {"size_bytes": size}
        unchecked = config.with_updates(runtime={"transfer_checksum": False})
        systems = {
            "link": partial(link, size, args.link_repeats, args.chunk_mib),
            "trainmover": partial(
                trainmover, config, run_dir / f"tm-{label}", args.warm_steps, args.repeats
            ),
            "trainmover_no_checksum": partial(
                trainmover,
                unchecked,
                run_dir / f"tm-nosum-{label}",
                args.warm_steps,
                args.repeats,
                failure=False,
            ),
            "ckpt": partial(checkpoint_restart, config, run_dir / f"ckpt-{label}", args.warm_steps),
        }
        for name, fn in systems.items():
            if name not in args.systems:
                measured[name] = "not chosen (--systems)"
                continue
            progress.note(f"{label}: {name} ...")
            measured[name] = attempt(fn)
            progress.step(f"{label}: {name}: {short(measured[name])}")
        runs[label] = measured
    result.set("runs", runs)
    rows = [size_row(m, args.chunk_mib) for m in runs.values()]
    result.set("rows", rows)
    result.set("projection", project(rows))
    return result


def human(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def short(out: Any) -> str:
    if isinstance(out, str):
        return out
    if "seconds" in out:
        return f"{min(out['seconds']):.3f} s best"
    if "planned" in out:
        planned = ", ".join(f"{p['downtime_s']:.3f}" for p in out["planned"])
        failure = f", failure {out['failure']['downtime_s']:.3f} s" if "failure" in out else ""
        return f"planned {planned} s{failure}"
    return f"{out['downtime_s']:.3f} s"


def write(result: Result, json_path: Path) -> None:
    md, png = outputs(json_path)
    result.write(json_path)
    md.write_text(table(result))
    rows = [r for r in result.get("rows") or [] if r.get("size_bytes")]
    xs = [r["size_bytes"] / (1 << 20) for r in rows]

    def series(key: str) -> list[dict[str, Any]]:
        return [{"median": r.get(key)} for r in rows]

    plot.lines(
        png,
        "Downtime against state size per rank (1 x 1 x 2, loopback)",
        xs,
        {
            "TrainMover planned": series("planned_downtime_s"),
            "TrainMover failure": series("failure_downtime_s"),
            "checkpoint-restart": series("ckpt_restart_downtime_s"),
        },
        "state per rank (MiB)",
        "downtime (s)",
        log=True,
    )


COLUMNS = [
    ("size_bytes", "state per rank (bytes)"),
    ("link_gbps", "link Gb/s"),
    ("transfer_gbps", "transfer Gb/s"),
    ("ratio_to_link", "ratio to link"),
    ("ratio_to_link_samples", "ratio per drain"),
    ("ratio_to_link_no_checksum", "ratio, no checksum"),
    ("streamed_alone_ratio", "transfer code alone / link"),
    ("leaver_overhead_mib", "leaver +MiB"),
    ("joiner_overhead_mib", "joiner +MiB"),
    ("replica_overhead_mib", "replica +MiB"),
    ("stayer_overhead_mib", "stayer +MiB"),
    ("planned_downtime_s", "planned s"),
    ("planned_over_transfer_s", "planned − transfer − step s"),
    ("failure_downtime_s", "failure s"),
    ("ckpt_restart_downtime_s", "ckpt-restart s"),
    ("ckpt_over_planned", "ckpt / planned"),
]


def table(result: Result) -> str:
    rows = result.get("rows") or []
    out = (
        "State size per rank against downtime and memory (1 x 1 x 2, loopback, chunks of "
        f"{result.get('chunk_mib')} MiB). Gb/s = 10^9 bits per second; +MiB = peak "
        "resident memory during the migration above the rank's peak before it.\n\n"
    )
    out += markdown_table([c[1] for c in COLUMNS], [[r.get(k) for k, _ in COLUMNS] for r in rows])
    projection = result.get("projection") or {}
    if projection.get("cases"):
        out += (
            f"\nProjection (transfer at {projection['ratio_to_link']:.2f} of a "
            f"{projection['nic_gbps']:.0f} Gb/s NIC per GPU, planned overhead "
            f"{projection['fixed_s']:.3f} s):\n\n"
        )
        out += markdown_table(
            ["case", "state per GPU (GB)", "transfer s", "planned downtime s"],
            [[c["case"], c["state_gb"], c["transfer_s"], c["planned_downtime_s"]]
             for c in projection["cases"]],
        )  # fmt: skip
    missing = [[human(r["size_bytes"]), system, reason]
               for r in rows for system, reason in r.get("not_measured", {}).items()]  # fmt: skip
    if missing:
        out += "\nNot measured\n\n" + markdown_table(["size", "system", "reason"], missing)
    return out


def main(args: argparse.Namespace) -> int:
    result = run(args)
    write(result, args.json)
    print(table(result))
    return 0
