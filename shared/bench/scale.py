"""``trainmover bench scale``: what the delta saves as the job grows.

(a) Measured: on loopback (gloo), TP2 x PP2 x DP(n/4) worlds of n = 4 .. 16 ranks, one
process per rank; rounds alternate rebuilding the delta of the machine serving cell
(dp 0, pp 0) (always 5 groups: its TP group, and a PP and a DP group per TP rank) and
rebuilding every group of the job. A round's time is from the harness's go to the last
participating rank's groups built.
(b) Projected: group and connection counts of the delta vs a full rebuild for layouts of
1,024 to 65,536 GPUs, and the predicted setup time on the critical path from a linear
model fitted to (a): t = a + b * (connections of the busiest rank) + c * (connections of
all groups rebuilt). The model is written down in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

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
from trainmover.bench.scale_worker import LEAVER, MODES, mode_groups, my_specs, rank_ref
from trainmover.runtime.layout import Layout

#: Projected layouts (TP x PP x DP): 1,024 .. 65,536 GPUs, TP inside an 8-GPU machine.
PROJECTED = [Layout(tp=8, pp=8, dp=16), Layout(tp=8, pp=16, dp=32),
             Layout(tp=8, pp=16, dp=128), Layout(tp=8, pp=32, dp=256)]  # fmt: skip


def pairs(size: int) -> int:
    """Connections of a full-mesh group (gloo connects every pair)."""
    return size * (size - 1) // 2


def counts(layout: Layout) -> dict[str, dict[str, int]]:
    """Groups, connections and the busiest rank's connections, for the delta of moving
    one machine and for a full rebuild. Closed forms (a 65,536-rank `all_groups()` is
    too big to enumerate); `check_counts` compares them with the layout's own lists."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    path = (tp - 1) + (pp - 1) + (dp - 1)  # a joiner rank builds one group of each kind
    return {
        "delta": {
            "groups": 1 + 2 * tp,  # its TP group; a PP and a DP group per TP rank
            "connections": pairs(tp) + tp * pairs(pp) + tp * pairs(dp),
            "rank_connections": path,
            "ranks": tp * (pp + dp - 1),
        },
        "fixed": {
            "groups": 1 + tp,  # its TP group; a PP group per TP rank
            "connections": pairs(tp) + tp * pairs(pp),
            "rank_connections": (tp - 1) + (pp - 1),
            "ranks": tp * pp,
        },
        "full": {
            "groups": pp * dp + dp * tp + pp * tp,
            "connections": pp * dp * pairs(tp) + dp * tp * pairs(pp) + pp * tp * pairs(dp),
            "rank_connections": path,
            "ranks": tp * pp * dp,
        },
    }


def check_counts(layout: Layout) -> None:
    """The closed forms agree with `Layout.all_groups()` / `groups_containing()`."""
    c = counts(layout)
    groups = layout.all_groups()
    delta = layout.groups_containing(layout.roles_of(LEAVER))
    assert c["full"]["groups"] == len(groups), (layout, len(groups))
    assert c["full"]["connections"] == sum(pairs(len(m)) for _, m in groups.values())
    assert c["delta"]["groups"] == len(delta), (layout, delta)
    assert c["delta"]["connections"] == sum(pairs(len(groups[n][1])) for n in delta)
    fixed = mode_groups(layout, "fixed") or []
    assert c["fixed"]["groups"] == len(fixed), (layout, fixed)
    assert c["fixed"]["connections"] == sum(pairs(len(groups[n][1])) for n in fixed)


class ScaleWorld:
    """n worker processes (their own session each) around a store this process hosts."""

    def __init__(self, layout: Layout, log_dir: Path):
        self.layout, self.n = layout, layout.tp * layout.pp * layout.dp
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=300))  # fmt: skip
        log_dir.mkdir(parents=True, exist_ok=True)
        spec = f"{layout.tp}x{layout.pp}x{layout.dp}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs = []
        for rank in range(self.n):
            with (log_dir / f"scale-{spec}-{rank}.log").open("ab") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "trainmover.bench.scale_worker", "--store",
                     f"127.0.0.1:{self.store.port}", "--rank", str(rank), "--layout", spec],
                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True))  # fmt: skip
        self.store.wait([f"hello/{r}" for r in range(self.n)])
        self.round = 0

        #: Tasks handed to each rank so far (its next task key is the count + 1).
        self.tasks = [0] * self.n
        #: The ranks with groups to build in each mode.
        self.members = {
            mode: [r for r in range(self.n) if my_specs(layout, rank_ref(layout, r), mode, 1)]
            for mode in MODES
        }

    def _hand(self, ranks: list[int], task: dict[str, Any]) -> None:
        for r in ranks:
            self.tasks[r] += 1
            self.store.set(f"task/{r}/{self.tasks[r]}", json.dumps(task))

    def build(self, mode: str) -> dict[str, Any]:
        """One round: every rank of `mode` rebuilds its groups; the slowest decides. The
        round ends when every participant has shut its new groups down again."""
        self.round += 1
        ranks = self.members[mode]
        go = time.time()
        self._hand(ranks, {"mode": mode, "round": self.round})
        keys = [f"round{self.round}/done/{r}" for r in ranks]
        self.store.wait(keys)
        done = [json.loads(self.store.get(k)) for k in keys]
        self.store.set(f"round{self.round}/close", "1")
        self.store.wait([f"round{self.round}/closed/{r}" for r in ranks])
        return {
            "mode": mode,
            "setup_s": max(d["t_end"] for d in done) - go,
            "slowest_rank_build_s": max(d["t_end"] - d["t_start"] for d in done),
            "ranks_building": len(done),
        }

    def close(self) -> None:
        self._hand(list(range(self.n)), {"mode": "end"})
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()


def fit(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares t = a + b * rank_connections + c * connections (non-negative; the
    busiest-rank term is dropped when the data cannot separate it)."""
    t = np.array([s["setup_s"] for s in samples])
    ones = np.ones_like(t)
    path = np.array([s["rank_connections"] for s in samples], dtype=float)
    total = np.array([s["connections"] for s in samples], dtype=float)
    coef = np.linalg.lstsq(np.stack([ones, path, total], 1), t, rcond=None)[0]
    if (coef < 0).any():
        a, c = np.linalg.lstsq(np.stack([ones, total], 1), t, rcond=None)[0]
        coef = np.array([max(a, 0.0), 0.0, max(c, 0.0)])
    return {"a_s": float(coef[0]), "b_s_per_rank_connection": float(coef[1]),
            "c_s_per_connection": float(coef[2])}  # fmt: skip


def predict(model: dict[str, float], c: dict[str, int]) -> float:
    return (model["a_s"] + model["b_s_per_rank_connection"] * c["rank_connections"]
            + model["c_s_per_connection"] * c["connections"])  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, required=True, help="result file (.md, .png beside)")
    parser.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=[4, 8, 16],
        help="ranks per measured world (multiples of 4: TP2 x PP2 x DP n/4)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds per mode and world")
    parser.add_argument("--run-dir", type=Path, help="worker logs (default: a temp dir)")


def run(args: argparse.Namespace) -> Result:
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-bench-scale-"))
    result = Result("scale", worlds=args.worlds, repeats=args.repeats, run_dir=str(run_dir))
    progress = Progress("scale", len(args.worlds) * args.repeats * len(MODES))
    measured: list[dict[str, Any]] = []
    # Every world is alive at once and rounds alternate between them: the shared cores'
    # load drifts over minutes, and measuring the worlds one after the other would
    # turn that drift into a trend with world size. Idle ranks sleep in the store.
    worlds: dict[int, ScaleWorld] = {}
    try:
        for n in args.worlds:
            progress.note(f"starting {n} rank processes")
            worlds[n] = ScaleWorld(Layout(tp=2, pp=2, dp=max(1, n // 4)), run_dir)
        for _ in range(args.repeats):
            for n, world in worlds.items():
                for mode in MODES:
                    row = {"world": n, **world.build(mode), **counts(world.layout)[mode]}
                    measured.append(row)
                    progress.step(f"{n} ranks {mode}: {row['setup_s']:.3f} s")
    finally:
        for world in worlds.values():
            world.close()
    result.set("measured.rounds", measured)
    by = {
        mode: {n: summary(r["setup_s"] for r in measured if r["world"] == n and r["mode"] == mode)
               for n in args.worlds}
        for mode in MODES
    }  # fmt: skip
    result.set("measured.setup_s", {m: {str(n): s for n, s in v.items()} for m, v in by.items()})
    lo, hi = min(args.worlds), max(args.worlds)
    result.set("measured.delta_growth", ratio(by["delta"][hi]["median"], by["delta"][lo]["median"]),
               "too few worlds")  # fmt: skip
    result.set("measured.fixed_growth",
               ratio(by["fixed"][hi]["median"], by["fixed"][lo]["median"]), "too few worlds")  # fmt: skip
    result.set("measured.full_growth", ratio(by["full"][hi]["median"], by["full"][lo]["median"]),
               "too few worlds")  # fmt: skip
    model = fit(measured)
    result.set("model", model)
    projected = []
    for layout in PROJECTED:
        c = counts(layout)
        projected.append({
            "layout": f"TP{layout.tp} x PP{layout.pp} x DP{layout.dp}",
            "gpus": layout.tp * layout.pp * layout.dp,
            **{f"{m}_{k}": v for m in ("delta", "full") for k, v in c[m].items()},
            "delta_setup_s": predict(model, c["delta"]),
            "full_setup_s": predict(model, c["full"]),
        })  # fmt: skip
    result.set("projected", projected)
    return result


def table(result: Result) -> str:
    g = result.get
    setup = g("measured.setup_s")
    worlds = list(setup["delta"])
    out = "Measured group setup on loopback (s, median (min–max))\n\n"
    rounds = g("measured.rounds")

    def conns(n: str, mode: str) -> int:
        return next(r["connections"] for r in rounds if str(r["world"]) == n and r["mode"] == mode)

    out += markdown_table(
        ["ranks", "delta", "delta connections", "fixed (TP + PP groups)", "full rebuild",
         "full connections"],
        [[n, fmt_stats(setup["delta"][n]), conns(n, "delta"), fmt_stats(setup["fixed"][n]),
          fmt_stats(setup["full"][n]), conns(n, "full")] for n in worlds],
    )  # fmt: skip
    growth = ", ".join(f"{m} x{_num(g(f'measured.{m}_growth'))}" for m in MODES)
    out += f"\nGrowth {worlds[0]} -> {worlds[-1]} ranks: {growth}\n"
    m = g("model")
    out += (f"\nModel: t = {m['a_s']:.4f} s + {m['b_s_per_rank_connection']:.5f} s x busiest-rank "
            f"connections + {m['c_s_per_connection']:.6f} s x all connections rebuilt\n\n")  # fmt: skip
    out += "Projected (one machine leaves)\n\n" + markdown_table(
        ["layout", "GPUs", "delta groups", "full groups", "delta connections",
         "full connections", "delta ranks", "predicted delta setup s", "predicted full setup s"],
        [[p["layout"], p["gpus"], p["delta_groups"], p["full_groups"], p["delta_connections"],
          p["full_connections"], p["delta_ranks"], p["delta_setup_s"], p["full_setup_s"]]
         for p in g("projected")],
    )  # fmt: skip
    return out


def _num(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def write(result: Result, json_path: Path) -> None:
    md, png = outputs(json_path)
    result.write(json_path)
    md.write_text(table(result))
    setup = result.get("measured.setup_s")
    worlds = list(setup["delta"])
    plot.lines(png, "Group setup time vs world size (loopback, gloo)", [int(n) for n in worlds],
               {"delta (5 groups)": [setup["delta"][n] for n in worlds],
                "fixed (the delta's TP + PP groups)": [setup["fixed"][n] for n in worlds],
                "full rebuild": [setup["full"][n] for n in worlds]},
               "ranks", "seconds")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    for layout in PROJECTED[:1]:
        check_counts(layout)  # 1,024 ranks: small enough to enumerate
    result = run(args)
    write(result, args.json)
    print(table(result))
    return 0
