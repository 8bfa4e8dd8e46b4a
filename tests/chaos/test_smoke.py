"""`trainmover chaos`, bounded: two faults of two kinds on a job of one rank per machine,
invariants hold, the run ends bit-identical to the uninterrupted reference, and the
second fault waits for the machine the first one killed to be back in the pool, warm.
Each kind of fault is tested end to end in tests/e2e; the 10-minute soak is not part of
the test suite: it is the same command with its defaults (docs/operations.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KINDS = ("machine_kill", "nats_restart")


def _chaos(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmover.cli", "chaos", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_fault_kind_is_one_clear_line() -> None:
    result = _chaos("--kinds", "drain,meteor", timeout=120)
    assert result.returncode == 2
    assert "unknown fault kinds ['meteor']" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_layout_is_one_clear_line() -> None:
    result = _chaos("--layout", "2x2", timeout=120)
    assert result.returncode == 2
    assert "layout '2x2' is not TPxPPxDP" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.long
@pytest.mark.timeout(2400)
def test_two_faults_recovered_without_violations(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    result = _chaos(
        "--kinds",
        ",".join(KINDS),
        "--in-order",
        "--max-faults",
        "2",
        "--seed",
        "3",
        "--dump-every",
        "10",
        "--layout",
        "1x2x2",
        "--workdir",
        str(tmp_path / "run"),
        "--json",
        str(out),
        timeout=2300,
    )
    printed = result.stdout
    assert "chaos soak summary (seed 3" in printed, printed[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["faults_injected"] == 2 and summary["faults_recovered"] == 2, printed[-3000:]
    assert [f["kind"] for f in report["faults"]] == list(KINDS)
    # Each fault went into a settled job: the killed machine was back and warm before
    # the bus restart (so the restart's cost is its own, not a warm-up beside it).
    assert [f["warm_standbys"] for f in report["faults"]] == [2, 2]
    violations = [v for f in report["faults"] for v in f["violations"]] + report["violations"]
    assert summary["invariant_violations"] == 0, violations
    assert summary["bitexact_to_reference"] is True
    assert report["compared_steps"][-1] == summary["final_step"]
    # The machine that was killed came back and ends as a standby or an active member.
    assert sorted(summary["by_kind"]) == sorted(KINDS)
    assert result.returncode == 0
