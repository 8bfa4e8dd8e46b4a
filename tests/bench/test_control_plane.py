"""`trainmover bench control-plane` end to end at its smallest size: 16 simulated
machines against the real planner, executor and health-monitor on a 3-server JetStream
cluster. What it measured must have happened: the silenced machine's failure event from
the health monitor, a plan for it and for the drain, and every command of each plan
answered by the machines it went to. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmover.bench.cli import main as bench_main
from trainmover.bench.control_plane_probe import workers_busy_s
from trainmover.bench.simmachine import CommandRecord

MACHINES = 16


def test_workers_busy_is_the_union_of_their_spans_within_the_window() -> None:
    def record(replied: float, busy: float) -> CommandRecord:
        return CommandRecord("m0", "prepare", "p", replied - busy - 0.01, replied, busy, True)

    # [1, 3] and [2, 4] overlap into [1, 4]; [6, 7] is cut at the window's end, 6.5.
    records = [record(3.0, 2.0), record(4.0, 2.0), record(7.0, 1.0), record(5.0, 0.0)]
    assert workers_busy_s(records, 0.0, 6.5) == pytest.approx(3.0 + 0.5)


@pytest.mark.timeout(240)
def test_the_real_services_answer_simulated_machines(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    code = bench_main(
        ["control-plane", "--machines", str(MACHINES), "--pp", "2", "--reps", "1",
         "--window", "2", "--timeout", "120", "--json", str(out), "--run-dir",
         str(tmp_path / "run")]
    )  # fmt: skip
    data = json.loads(out.read_text())
    size = data["sizes"][str(MACHINES)]
    assert code == 0 and "failed" not in size, size.get("failed")
    assert out.with_suffix(".md").read_text().count("|") > 4
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    rows = {row["kind"]: row for row in size["migrations"]}
    assert set(rows) == {"drain", "failure"}
    failure, drain = rows["failure"], rows["drain"]
    # The silenced machine's heartbeats stopped: the monitor failed it, nobody else.
    assert failure["source"] == "heartbeat" and failure["detect_s"] > 0
    assert size["spurious_failures"] == []
    for row in (drain, failure):
        assert row["plan_id"] and row["end_state"] == "done"
        assert row["commands_failed"] == 0
    assert drain["migration"] == "planned" and failure["migration"] == "unplanned"
    # A drain: phase 1, the switch step, the switch and the leaver's release.
    assert drain["commands"]["prepare"] == drain["affected"] <= drain["commands"]["commit"]
    assert drain["commands"]["transfer"] == drain["affected"]
    assert drain["commands"]["release"] == 1
    # A recovery: every machine that keeps its role, and the joiner, recovered and switched.
    assert failure["commands"]["recover"] == failure["commands"]["transfer"] == MACHINES
    assert size["state_bytes"] > 0 and size["cpu_cores"]["health-monitor"] >= 0
