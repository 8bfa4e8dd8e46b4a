"""Smoke runs of `trainmover bench` on the smallest settings: each sub-command runs end to
end and writes its JSON (with the issue's keys: numbers, or null with a reason), its
Markdown table and its PNG. No timing is asserted: benchmarks report, tests check shape.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

import pytest

from trainmover.bench.cli import main as bench_main
from trainmover.cli import main as cli_main

#: The smallest job: 2 machines of 1 rank per replica, 2 replicas, tiny model.
SMALL = ["--layout", "1x2x2", "--tiny"]

DOWNTIME_KEYS = [
    "trainmover.planned_downtime_s",
    "trainmover.failure_downtime_s",
    "checkpoint_restart.planned_downtime_s",
    "checkpoint_restart.failure_downtime_s",
    "torchft.failure_downtime_s",
    "ratio.planned",
    "ratio.failure",
    "ratio.failure_vs_torchft",
    "runtime_floor.planned_downtime_s",
    "ablations.full_rebuild.planned_downtime_s",
    "ablations.no_shadow.planned_downtime_s",
    "ablations.no_overlap.planned_downtime_s",
    "trainmover.phases_s.prepare",
    "trainmover.phases_s.transfer",
    "trainmover.phases_s.first_step",
    "checkpoint_restart.failure_phases_s.detect_and_respawn",
    "memory_mib.stayer_overhead_max",
    "memory_mib.joiner_standby",
    "trainmover.failure_phases_s.recover",
    "trainmover.failure_end_to_end_s",
    "trainmover.joiner_first_iteration_s",
    "ablations.no_shadow.joiner_first_iteration_s",
]
#: Measured on every run (TrainMover's own side never depends on a peer system).
TRAINMOVER_KEYS = [
    "trainmover.planned_downtime_s",
    "trainmover.failure_downtime_s",
    "runtime_floor.planned_downtime_s",
    "ablations.full_rebuild.planned_downtime_s",
    "ablations.no_overlap.planned_downtime_s",
    "ablations.no_shadow.planned_downtime_s",
]


def lookup(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"{dotted}: missing {part!r}"
        node = node[part]
    return node


def check_keys(data: dict[str, Any], keys: list[str]) -> None:
    """Each key is a number, or null with its reason recorded under "unavailable"."""
    for key in keys:
        value = lookup(data, key)
        if value is None:
            assert data["unavailable"].get(key), f"{key} is null without a reason"
        else:
            assert isinstance(value, numbers.Real), f"{key} = {value!r}"


def check_outputs(json_path: Path) -> dict[str, Any]:
    data = json.loads(json_path.read_text())
    assert json_path.with_suffix(".md").read_text().count("|") > 4
    assert json_path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    return data


# About 25 process starts (every system, each event's fresh standby) on 2 shared cores.
@pytest.mark.long
@pytest.mark.timeout(1200)
def test_downtime(tmp_path: Path) -> None:
    out = tmp_path / "downtime.json"
    args = ["downtime", "--json", str(out), *SMALL, "--repeats", "1", "--warm-steps", "3",
            "--every", "4", "--torchft-timeouts", "1"]  # fmt: skip
    # Through the top-level CLI, as `trainmover bench ...` runs it.
    assert cli_main(["bench", *args]) == 0
    data = check_outputs(out)
    check_keys(data, DOWNTIME_KEYS)
    # Every TrainMover measurement runs: through the services a drain and a SIGKILLed
    # machine recovered from its DP replica; over the runtime alone its floor and the
    # three ablations. Each row says how it was driven.
    for key in TRAINMOVER_KEYS:
        assert lookup(data, key) is not None, data["unavailable"].get(key)
    assert lookup(data, "trainmover.failure_phases_s.detect") >= 0
    runs = data["runs"]
    assert {
        r["control_plane"] for r in runs["trainmover.planned"] + runs["trainmover.failure"]
    } == {"services"}
    assert data["trainmover"]["control_plane"] == "services"
    assert data["runtime_floor"]["control_plane"] == "runtime"
    assert all(r["warm_joiner"] for r in runs["trainmover.planned"])
    assert all(r["source"] == "unplanned" for r in runs["trainmover.failure"])
    assert all(r["warm_joiner"] for r in runs["runtime.delta"])
    assert not any(r["warm_joiner"] for r in runs["runtime.no_shadow"])


# The stack of trainmover up with one standby, and one window pair.
@pytest.mark.long
@pytest.mark.timeout(1200)
def test_rebalance(tmp_path: Path) -> None:
    out = tmp_path / "rebalance.json"
    args = ["rebalance", "--json", str(out), *SMALL, "--period", "6", "--duration", "6",
            "--project", "600"]  # fmt: skip
    assert bench_main(args) == 0
    data = check_outputs(out)
    check_keys(data, ["training_time_ratio", "accounted_ratio", "projected_ratio_600s",
                      "stayer_phase1_slowdown", "migration.downtime_s", "counted_ratio",
                      "projected_counted_ratio_600s", "migration.counted_cost_s"])  # fmt: skip
    assert data["control_plane"] == "services"
    assert all(len(w["migrations"]) == 1 for w in data["runs"]["with"])


@pytest.mark.long
def test_scale(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert bench_main(["scale", "--json", str(out), "--worlds", "4", "8", "--repeats", "1"]) == 0
    data = check_outputs(out)
    check_keys(data, ["measured.delta_growth", "measured.fixed_growth", "measured.full_growth", "model.a_s",
                      "model.c_s_per_connection"])  # fmt: skip
    projected = data["projected"]
    assert [p["gpus"] for p in projected] == [1024, 4096, 16384, 65536]
    for p in projected:
        assert p["delta_groups"] < p["full_groups"]
        assert p["delta_connections"] < p["full_connections"]
        assert isinstance(p["delta_setup_s"], float)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_store(tmp_path: Path) -> None:
    out = tmp_path / "store.json"
    args = ["store", "--json", str(out), "--kills", "1", "--ranks", "2,4", "--steps", "12",
            "--rounds", "1", "--local-ranks", "2", "--job-steps", "10"]  # fmt: skip
    assert bench_main(args) == 0
    data = check_outputs(out)
    check_keys(data, ["loss.lost_s_median", "loss.median_step_s", "projection.machines.at_1024_ms",
                      "projection.trainmover.store_cpu_ms_per_voter",
                      "goals.vote_share_at_largest", "goals.projected_share_at_1024",
                      "goals.vote_share_in_job"])  # fmt: skip
    (loss,) = data["loss"]["rows"]
    assert loss["new_incarnation"] and loss["failures_declared"] == 0
    assert [r["ranks"] for r in data["votes"]] == [2, 4]
    for row in data["votes"]:
        assert row["trainmover_vote_ms"] > 0 and row["tcpstore_vote_ms"] > 0
        assert row["machines_vote_ms"] > 0 and row["machines_store_cpu_ms"] > 0
        # Machines of 2 ranks: half the voters in the job's store.
        assert row["machines_voters"] == row["ranks"] // 2
        assert row["trainmover_voters"] == row["ranks"]
        assert row["sharded_vote_ms"] > 0 and row["sharded_voters"] == row["ranks"]
    assert data["projection"]["machines"]["voters_at_1024"] == 1024 // 8
    # With shards the job's store's busiest path is a fraction of the flat vote's.
    sharded = data["projection_sharded"]
    assert sharded["serial_requests_at_1024"] < sharded["flat_requests_at_1024"] / 3
    assert 0 < data["goals"]["projected_share_at_1024_sharded"]
    # The vote inside the reference job at the largest size: 2 machines of 2 ranks.
    in_job = data["in_job"]
    assert in_job["ranks"] == 4 and in_job["layout"]["tp"] == 2 and in_job["steps"] >= 9
    assert 0 < in_job["vote_ms"] < in_job["median_step_ms"]
    # The same job with its store's shards (2 machines: a shard each).
    sharded_job = data["in_job_sharded"]
    assert sharded_job["shards"] == 2 and sharded_job["steps"] >= 9
    assert 0 < sharded_job["vote_ms"] < sharded_job["median_step_ms"]
    assert "sharded" not in data["projection"]
    # The progress board's beacons at the largest size, per rank and folded per machine
    # (their CPU above an idle store's is within this host's noise at 4 ranks).
    board = data["board"]
    assert board["ranks"] == 4 and board["local_ranks"] == 2 and board["idle_ms_per_s"] > 0
    check_keys(board, ["per_rank.store_cpu_ms_per_s", "per_machine.store_cpu_ms_per_s"])
    for way in ("per_rank", "per_machine"):
        assert board["at_1024_ms_per_s"][way] > 0


@pytest.mark.parametrize("layout", ["1x2x2", "2x2x2", "8x8x16"])
def test_projected_counts_match_the_layout(layout: str) -> None:
    from trainmover.bench.scale import check_counts
    from trainmover.bench.settings import parse_layout

    check_counts(parse_layout(layout))
