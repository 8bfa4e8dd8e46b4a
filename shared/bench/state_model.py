"""The state benchmark's arithmetic (pure): one row per size from what was measured, and
the projection of the measured model to a large job.

A row's memory overheads are peak resident memory (VmHWM) once a migration is over minus
the peak as its transfer started: what the transfer added on top of everything the rank
had needed before, training included; the worst of the size's planned migrations. Its
times and throughputs are their medians (`ratio_to_link_samples`: each one's ratio).
`overhead_budget_mib` is the issue's bound: one chunk buffer plus 5 % of the rank's
steady peak.
"""

from __future__ import annotations

import statistics
from typing import Any

#: Bytes of training state per parameter in mixed precision with Adam: bf16 weights (2),
#: fp32 master weights (4), two fp32 moments (8).
STATE_BYTES_PER_PARAM = 14
NIC_GBPS = 400.0
#: The projection's cases: (name, state bytes per GPU).
CASES = [
    ("70B, FSDP fully sharded over 1,024 GPUs", 70e9 * STATE_BYTES_PER_PARAM / 1024),
    ("70B, TP8 x PP8 x DP16, ZeRO-1 over DP", 70e9 / 64 * (2 + 12 / 16)),
    ("70B, TP8 x PP8 x DP16, nothing sharded over DP", 70e9 * STATE_BYTES_PER_PARAM / 64),
]
#: Sizes below this are latency-bound: the projection's throughput comes from larger ones.
PROJECT_FROM_BYTES = 256 << 20


def gbps(nbytes: float, seconds: float | None) -> float | None:
    """Gigabits per second (10^9 bits)."""
    return None if not seconds or seconds <= 0 else nbytes * 8 / 1e9 / seconds


def _over(memory: dict[str, dict[str, float]], machine: str | None) -> float | None:
    entry = memory.get(machine or "", {})
    if "before" not in entry or "after" not in entry:
        return None
    return round(entry["after"] - entry["before"], 1)


def _ok(value: Any) -> dict[str, Any] | None:
    """A measurement's result, None for a failed one (its reason string)."""
    return value if isinstance(value, dict) else None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _worst(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _planned(samples: list[dict[str, Any]], size: int, chunk_mib: float) -> dict[str, Any]:
    """The planned migrations' part of a row: medians over the samples (the transfer
    from the joiner's own receive), the worst memory overhead of any."""
    if not samples:
        return {}
    each = []
    for planned in samples:
        memory = planned.get("memory", {})
        # The joiner's own receive, from the leaver's first byte to its last chunk
        # checked; the joiner's wait before that (the leaver's last step) is downtime,
        # kept apart as transfer_wait_s, but not the link.
        joiner = memory.get(planned["joiner"], {})
        transfer, downtime = joiner.get("transfer_s"), planned["downtime_s"]
        stayers = [m for m in memory if m not in (planned["leaver"], planned["joiner"])]
        each.append({
            "transfer_s": transfer,
            "transfer_wait_s": joiner.get("transfer_wait_s"),
            "transfer_phase_s": planned["phases_s"].get("transfer"),
            "normal_step_s": planned["normal_step_s"],
            "planned_downtime_s": downtime,
            "planned_over_transfer_s": (
                downtime - transfer - planned["normal_step_s"]
                if transfer is not None and downtime is not None
                else None
            ),
            "leaver_overhead_mib": _over(memory, planned["leaver"]),
            "joiner_overhead_mib": _over(memory, planned["joiner"]),
            "stayer_overhead_mib": _over(memory, stayers[0]) if stayers else None,
            "steady_peak_mib": max((e.get("before", 0.0) for e in memory.values()), default=0.0),
        })  # fmt: skip
    out: dict[str, Any] = {"planned_samples": len(samples)}
    for key in each[0]:
        values = [e[key] for e in each]
        worst = key.endswith("_overhead_mib") or key == "steady_peak_mib"
        out[key] = _worst(values) if worst else _median(values)
    out["transfer_gbps"] = gbps(size, out["transfer_s"])
    out["transfer_gbps_samples"] = [gbps(size, e["transfer_s"]) for e in each]
    out["overhead_budget_mib"] = round(chunk_mib + 0.05 * out["steady_peak_mib"], 1)
    return out


def size_row(measured: dict[str, Any], chunk_mib: float) -> dict[str, Any]:
    """The JSON row of one size from its raw measurements (`link`, `trainmover`, `ckpt`;
    a failed one is its reason string, kept under `not_measured`)."""
    size = measured["size_bytes"]
    row: dict[str, Any] = {"size_bytes": size}
    row["not_measured"] = {k: v for k, v in measured.items() if isinstance(v, str)}
    link, tm, ckpt = (
        _ok(measured.get("link")),
        _ok(measured.get("trainmover")),
        _ok(measured.get("ckpt")),
    )
    row["link_gbps"] = gbps(size, statistics.median(link["seconds"])) if link else None
    for key in ("streamed", "streamed_no_checksum"):
        samples = link.get(f"{key}_seconds") if link else None
        row[f"{key}_alone_gbps"] = gbps(size, statistics.median(samples)) if samples else None
    row["streamed_alone_ratio"] = (
        row["streamed_alone_gbps"] / row["link_gbps"]
        if row["streamed_alone_gbps"] and row["link_gbps"]
        else None
    )
    samples = tm["planned"] if tm else []
    failure = tm["failure"] if tm else None
    row |= _planned(samples, size, chunk_mib)
    row["ratio_to_link"] = (
        row["transfer_gbps"] / row["link_gbps"]
        if row.get("transfer_gbps") and row.get("link_gbps")
        else None
    )
    each_gbps, link_gbps = row.pop("transfer_gbps_samples", []), row["link_gbps"]
    row["ratio_to_link_samples"] = [round(g / link_gbps, 3) for g in each_gbps if g and link_gbps]
    if failure:
        memory = failure.get("memory", {})
        source = next((m for m in memory if m != failure["joiner"]), None)
        row |= {
            "failure_downtime_s": failure["downtime_s"],
            "failure_transfer_s": memory.get(failure["joiner"], {}).get("transfer_s"),
            "replica_overhead_mib": _over(memory, source),
            "failure_joiner_overhead_mib": _over(memory, failure["joiner"]),
        }
    unchecked = _ok(measured.get("trainmover_no_checksum"))
    if unchecked:
        plain = _planned(unchecked["planned"], size, chunk_mib)
        row["transfer_gbps_no_checksum"] = plain.get("transfer_gbps")
        row["planned_downtime_no_checksum_s"] = plain.get("planned_downtime_s")
        row["ratio_to_link_no_checksum"] = (
            row["transfer_gbps_no_checksum"] / row["link_gbps"]
            if row["transfer_gbps_no_checksum"] and row.get("link_gbps")
            else None
        )
    row["ckpt_restart_downtime_s"] = ckpt["downtime_s"] if ckpt else None
    row["ckpt_restart_phases_s"] = ckpt["phases_s"] if ckpt else None
    planned_s = row.get("planned_downtime_s")
    row["ckpt_over_planned"] = (
        row["ckpt_restart_downtime_s"] / planned_s
        if row["ckpt_restart_downtime_s"] is not None and planned_s and planned_s > 0
        else None
    )
    overheads = [row.get(k) for k in ("leaver_overhead_mib", "joiner_overhead_mib",
                                       "replica_overhead_mib", "failure_joiner_overhead_mib")]  # fmt: skip
    measured_overheads = [o for o in overheads if o is not None]
    row["within_memory_budget"] = (
        all(o <= row["overhead_budget_mib"] for o in measured_overheads)
        if measured_overheads and "overhead_budget_mib" in row
        else None
    )
    return row


def project(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured model at a large job's sizes: transfer at the measured fraction of
    the link (median over sizes from 256 MiB) on a 400 Gb/s NIC per GPU, plus the
    measured fixed part of a planned migration (downtime - transfer - one step, median).
    None of it measured on such a job: an extrapolation, said so in the docs."""
    big = [r for r in rows if r["size_bytes"] >= PROJECT_FROM_BYTES]
    ratios = [r["ratio_to_link"] for r in big if r.get("ratio_to_link")]
    fixed = [
        r["planned_over_transfer_s"] for r in rows if r.get("planned_over_transfer_s") is not None
    ]
    if not ratios or not fixed:
        return {"cases": [], "reason": "no size from 256 MiB up measured"}
    ratio, fixed_s = statistics.median(ratios), max(0.0, statistics.median(fixed))
    cases = []
    for name, nbytes in CASES:
        transfer_s = nbytes * 8 / (ratio * NIC_GBPS * 1e9)
        cases.append({
            "case": name,
            "state_gb": round(nbytes / 1e9, 2),
            "transfer_s": round(transfer_s, 3),
            "planned_downtime_s": round(fixed_s + transfer_s, 3),
        })  # fmt: skip
    return {"ratio_to_link": ratio, "nic_gbps": NIC_GBPS, "fixed_s": fixed_s, "cases": cases}
