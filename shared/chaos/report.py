"""What a chaos soak is asked to do and what it reports: its settings (checked), one
record per fault, the report with its summary per fault kind, and the printed summary.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainmover.chaos.faults import FAULT_KINDS, SINGLE_SERVER_KINDS
from trainmover.runtime.layout import Layout


@dataclass
class SoakSettings:
    """What `trainmover chaos` runs: its flags, checked on construction."""

    duration_s: float = 600.0
    max_faults: int = 40
    seed: int | None = None
    kinds: tuple[str, ...] = SINGLE_SERVER_KINDS
    workdir: Path | None = None
    recovery_timeout_s: float = 300.0
    dump_every: int = 20
    #: Standby machines: every fault but a server restart takes one from the pool until
    #: its machine is back and warm, so more standbys allow more faults per minute.
    standbys: int = 2
    reference: bool = True
    #: Take `kinds` in their order, round and round, instead of at random.
    in_order: bool = False
    #: The bus as a JetStream cluster of this many embedded servers (1: one server).
    nats_cluster: int = 1
    #: The job's layout: TP ranks per machine, PP x DP machines.
    layout: Layout = field(default_factory=lambda: Layout(tp=2, pp=2, dp=2))
    #: Shards of the rendezvous store the commit vote counts in (0: the store alone).
    store_shards: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown or not self.kinds:
            raise ValueError(
                f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(FAULT_KINDS)}"
            )
        if self.duration_s <= 0 or self.max_faults < 1 or self.dump_every < 1:
            raise ValueError("duration, max faults and dump interval must be positive")
        if self.standbys < 1:
            raise ValueError("the soak needs at least one standby")
        if "nats_node_kill" in self.kinds and self.nats_cluster < 3:
            raise ValueError("nats_node_kill needs a bus cluster: --nats-cluster 3 (or more)")
        if not 0 <= self.store_shards <= self.layout.machines:
            raise ValueError(
                f"--store-shards {self.store_shards}: from 0 to the job's "
                f"{self.layout.machines} machines"
            )


@dataclass
class FaultRecord:
    """One injected fault: what, where, when, and what recovery it saw."""

    index: int
    kind: str
    target: str | None
    detail: str
    at_s: float
    step: int
    recovered: bool = False
    recovery_s: float | None = None
    #: Training time lost in the fault's window: the time between the stamps of the last
    #: step before the fault and the first step past its recovery, less the steps done
    #: meanwhile times the normal step time measured before the fault (`lost_time`).
    lost_s: float | None = None
    #: The longest single hold within that window: the largest gap between two of the
    #: job's consecutive steps, less their normal time (`longest_stall`). Near `lost_s`:
    #: the job waited once; far below it: the steps ran slower throughout (a busy host).
    stall_s: float | None = None
    #: How much longer than before the fault the job's steps in that window waited for a
    #: CPU (`Observer.queued_extra`): near `lost_s` with a short `stall_s`, the steps were
    #: slowed by other processes on the cores (on one host: a leaver warming up as a
    #: standby again, or the bus servers' own restart).
    queued_extra_s: float | None = None
    #: Warm standbys in the pool when the fault was injected (the soak waits for all).
    warm_standbys: int | None = None
    migration_downtime_s: list[float] = field(default_factory=list)
    migrations: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


@dataclass
class SoakReport:
    """A whole soak: its faults, violations and the comparison with the reference."""

    seed: int
    settings: dict[str, object]
    faults: list[FaultRecord] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    final_step: int | None = None
    compared_steps: list[int] = field(default_factory=list)
    bitexact: bool | None = None
    wall_s: float = 0.0
    workdir: str = ""

    def summary(self) -> dict[str, object]:
        kinds: dict[str, dict[str, object]] = {}
        for kind in sorted({f.kind for f in self.faults}):
            mine = [f for f in self.faults if f.kind == kind]
            lost = [f.lost_s for f in mine if f.lost_s is not None]
            mig = [d for f in mine for d in f.migration_downtime_s]
            kinds[kind] = {
                "injected": len(mine),
                "recovered": sum(f.recovered for f in mine),
                "lost_s_median": _median(lost),
                "lost_s_max": max(lost, default=None),
                "migration_downtime_s_median": _median(mig),
                "migration_downtime_s_max": max(mig, default=None),
                "recovery_s_median": _median([f.recovery_s for f in mine if f.recovery_s]),
            }
        violations = [v for f in self.faults for v in f.violations] + self.violations
        return {
            "seed": self.seed,
            "wall_s": round(self.wall_s, 1),
            "faults_injected": len(self.faults),
            "faults_recovered": sum(f.recovered for f in self.faults),
            "invariant_violations": len(violations),
            "final_step": self.final_step,
            "bitexact_to_reference": self.bitexact,
            "by_kind": kinds,
        }

    def to_json(self) -> str:
        return json.dumps({"summary": self.summary(), **asdict(self)}, indent=2, default=str)


def lost_time(before: tuple[float, int], after: tuple[float, int], step_s: float) -> float:
    """Training time lost between two (stamp, step) points of the job's timeline: the
    time between them less the steps done times the normal step. Stamps are the
    machines' own, so a bus that delivers the statistics late adds nothing."""
    (t0, s0), (t1, s1) = before, after
    return round(max(0.0, (t1 - t0) - (s1 - s0) * step_s), 3)


def longest_stall(
    timeline: list[tuple[float, int]], before: tuple[float, int], step_s: float
) -> float:
    """The largest gap between consecutive (stamp, step) points of `timeline` from
    `before` on, less the normal time of the steps between them."""
    points = [p for p in timeline if p[0] >= before[0]]
    gaps = (
        (t1 - t0) - (s1 - s0) * step_s
        for (t0, s0), (t1, s1) in zip(points, points[1:], strict=False)
    )
    return round(max([0.0, *gaps]), 3)


def lost_text(record: FaultRecord) -> str:
    """The training time a fault cost, as the soak prints it: what was lost, its longest
    single hold, and the extra waiting for a CPU."""
    if record.lost_s is None:
        return ""
    why = [f"longest hold {record.stall_s:.2f}s"] if record.stall_s is not None else []
    if record.queued_extra_s is not None:
        why.append(f"{record.queued_extra_s:+.2f}s waiting for a CPU")
    return f", lost {record.lost_s:.2f}s" + (f" ({', '.join(why)})" if why else "")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def print_summary(report: SoakReport) -> None:
    """Prints the summary table and every violation."""
    summary = report.summary()
    print()
    print(f"chaos soak summary (seed {report.seed}, {summary['wall_s']}s)")
    print(
        f"faults injected {summary['faults_injected']}, recovered {summary['faults_recovered']}, "
        f"invariant violations {summary['invariant_violations']}, final step "
        f"{summary['final_step']}, bit-identical to the reference: {summary['bitexact_to_reference']}"
    )
    print(
        f"{'kind':<14}{'n':>3}{'ok':>4}{'lost med':>10}{'lost max':>10}{'mig med':>9}{'mig max':>9}"
    )
    by_kind: dict[str, dict[str, object]] = summary["by_kind"]  # type: ignore[assignment]
    for kind, row in by_kind.items():
        print(
            f"{kind:<14}{row['injected']:>3}{row['recovered']:>4}"
            + "".join(f"{_fmt(row[k]):>10}" for k in ("lost_s_median", "lost_s_max"))
            + "".join(
                f"{_fmt(row[k]):>9}"
                for k in ("migration_downtime_s_median", "migration_downtime_s_max")
            )
        )
    violations = [v for f in report.faults for v in f.violations] + report.violations
    for v in violations:
        print(f"VIOLATION: {v}")


def _fmt(value: object) -> str:
    return "-" if value is None else f"{value:.2f}s"  # type: ignore[str-format]
