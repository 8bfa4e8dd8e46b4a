"""`trainmover bench state`: its arithmetic (pure), its options, and a smoke run of the
product path at a tiny size (numbers are reported, never asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from trainmover.bench.cli import main as bench_main
from trainmover.bench.state import parse_sizes, parse_systems, positive
from trainmover.bench.state_model import CASES, NIC_GBPS, project, size_row

MIB = 1 << 20
GIB = 1 << 30


def test_sizes_take_binary_units_and_refuse_nonsense() -> None:
    assert parse_sizes("16M, 1G,512K,100") == [16 * MIB, GIB, 512 * 1024, 100]
    assert parse_sizes("0.5G") == [GIB // 2]
    for bad in ("", "twelveM", "0M", "-1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_sizes(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown system 'torchft'"):
        parse_systems("link,torchft")
    for bad in ("0", "two", "-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
            positive(bad)
    assert positive("3") == 3


def drain(transfer_s: float, joiner_peak: float) -> dict:
    """One planned migration m0 -> s0 as the benchmark records it."""
    memory = {
        "m0": {"before": 1000.0, "after": 1000.5, "transfer_s": transfer_s + 0.05},
        "s0": {
            "before": 1100.0,
            "after": joiner_peak,
            "transfer_s": transfer_s,
            "transfer_wait_s": 0.04,
        },
        "m1": {"before": 1000.0, "after": 1000.0},
    }
    return {"leaver": "m0", "joiner": "s0", "downtime_s": transfer_s + 0.3,
            "normal_step_s": 0.1, "phases_s": {"transfer": transfer_s + 0.05},
            "memory": memory}  # fmt: skip


def measured(
    size: int, transfer_s: float, link_s: float, joiner_peak: float, drains: int = 1
) -> dict:
    """Raw measurements of one size as the benchmark collects them."""
    failure = {"joiner": "m0", "downtime_s": 2.0, "phases_s": {},
               "memory": {"m1": {"before": 1000.0, "after": 1001.0, "transfer_s": 1.0},
                          "m0": {"before": 900.0, "after": 900.2, "transfer_s": 1.0}}}  # fmt: skip
    return {
        "size_bytes": size,
        "link": {
            "bytes": size,
            "seconds": [link_s, link_s / 2, link_s * 2],
            "streamed_seconds": [link_s * 1.25] * 3,
        },
        "trainmover": {
            "planned": [drain(transfer_s, joiner_peak) for _ in range(drains)],
            "failure": failure,
        },
        "trainmover_no_checksum": "not chosen (--systems)",
        "ckpt": {"downtime_s": 30.0, "phases_s": {"save": 5.0}},
    }


def test_a_row_reads_throughput_from_the_joiners_receive_and_memory_above_the_start() -> None:
    row = size_row(measured(GIB, transfer_s=1.0, link_s=0.8, joiner_peak=1100.9), chunk_mib=64)
    assert row["transfer_gbps"] == pytest.approx(GIB * 8 / 1e9)
    assert row["link_gbps"] == pytest.approx(GIB * 8 / 1e9 / 0.8)  # the median repeat
    assert row["ratio_to_link"] == pytest.approx(0.8)
    assert row["streamed_alone_ratio"] == pytest.approx(0.8)
    assert row["streamed_no_checksum_alone_gbps"] is None  # not in this probe's output
    assert row["joiner_overhead_mib"] == pytest.approx(0.9)
    assert row["leaver_overhead_mib"] == pytest.approx(0.5)
    assert row["stayer_overhead_mib"] == 0.0
    assert row["replica_overhead_mib"] == pytest.approx(1.0)
    assert row["planned_over_transfer_s"] == pytest.approx(0.2)
    assert row["transfer_wait_s"] == pytest.approx(0.04)  # the joiner's, not the leaver's
    assert row["ckpt_over_planned"] == pytest.approx(30.0 / 1.3)
    assert row["within_memory_budget"] is True
    assert row["not_measured"] == {"trainmover_no_checksum": "not chosen (--systems)"}
    assert "ratio_to_link_no_checksum" not in row  # that run was not chosen


def test_a_row_takes_the_drains_medians_and_their_worst_memory() -> None:
    raw = measured(GIB, transfer_s=1.0, link_s=0.8, joiner_peak=1100.9, drains=3)
    drains = raw["trainmover"]["planned"]
    drains[1] = drain(4.0, joiner_peak=1100.9)  # a slow one
    drains[2] = drain(0.8, joiner_peak=1150.0)  # one that took more memory
    row = size_row(raw, chunk_mib=64)
    assert row["planned_samples"] == 3
    assert row["transfer_s"] == pytest.approx(1.0)  # the median drain's
    assert row["ratio_to_link"] == pytest.approx(0.8)
    assert row["ratio_to_link_samples"] == pytest.approx([0.8, 0.2, 1.0])
    assert row["planned_downtime_s"] == pytest.approx(1.3)
    assert row["joiner_overhead_mib"] == pytest.approx(50.0)  # the worst drain's


def test_a_joiner_that_doubled_its_state_is_over_the_budget() -> None:
    row = size_row(measured(GIB, 1.0, 0.8, joiner_peak=1100.0 + 1024.0), chunk_mib=64)
    assert row["joiner_overhead_mib"] == pytest.approx(1024.0)
    assert row["within_memory_budget"] is False


def test_the_projection_uses_the_large_sizes_ratio_and_the_fixed_part() -> None:
    rows = [
        size_row(measured(16 * MIB, 0.1, 0.01, 1100.5), 64),  # latency-bound: left out
        size_row(measured(GIB, 1.0, 0.5, 1100.5), 64),
        size_row(measured(4 * GIB, 4.0, 2.0, 1100.5), 64),
    ]
    out = project(rows)
    assert out["ratio_to_link"] == pytest.approx(0.5)
    assert out["fixed_s"] == pytest.approx(0.2)
    assert [c["case"] for c in out["cases"]] == [name for name, _ in CASES]
    first = out["cases"][0]
    expected = CASES[0][1] * 8 / (0.5 * NIC_GBPS * 1e9)
    assert first["transfer_s"] == pytest.approx(expected, abs=1e-3)
    assert first["planned_downtime_s"] == pytest.approx(expected + 0.2, abs=1e-3)
    assert project(rows[:1])["cases"] == []


# Two stacks of `trainmover up` (a drain, then a SIGKILL) and the raw link at 1 MiB.
@pytest.mark.long
@pytest.mark.timeout(600)
def test_state_smoke(tmp_path: Path) -> None:
    out = tmp_path / "state.json"
    args = ["state", "--json", str(out), "--sizes", "1M", "--warm-steps", "3",
            "--link-repeats", "1", "--repeats", "2", "--systems", "link,trainmover"]  # fmt: skip
    assert bench_main(args) == 0
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "ratio to link" in out.with_suffix(".md").read_text()
    (row,) = data["rows"]
    assert row["size_bytes"] == MIB
    for key in ("link_gbps", "transfer_gbps", "ratio_to_link", "leaver_overhead_mib",
                "joiner_overhead_mib", "planned_downtime_s", "failure_downtime_s"):  # fmt: skip
        assert isinstance(row[key], float), (key, row)
    assert row["ckpt_restart_downtime_s"] is None
    assert set(row["not_measured"]) == {"trainmover_no_checksum", "ckpt"}
    # The joiner's own log gave its receive time and its peak memory around it.
    first, second = data["runs"]["1M"]["trainmover"]["planned"]
    # The second drain moved the role back to the machine the first drained, once warm.
    assert (second["leaver"], second["joiner"]) == (first["joiner"], first["leaver"])
    assert row["planned_samples"] == 2 and len(row["ratio_to_link_samples"]) == 2
    for planned in (first, second):
        assert planned["warm_joiner"]
        assert {"before", "after", "transfer_s"} <= set(planned["memory"][planned["joiner"]])
