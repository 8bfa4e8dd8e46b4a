"""`trainmover demo --example ddp|llama` through the real stack, as a user runs it.

The CLI in a child process: embedded nats-server, planner, executor, health-monitor and
a sidecar per machine running examples/ddp (or examples/llama); a drain, a SIGKILL and a straggler; then the
uninterrupted run of the same script and the bit-exact comparison, into --json.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainmover.demo import DemoReport, MigrationRow

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]


def run_demo(example: str, tmp_path: Path) -> dict:
    """`trainmover demo --example EXAMPLE` in a child process; its --json report, checked
    to have the reference demo's keys and three completed migrations."""
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [sys.executable, "-m", "trainmover.cli", "demo", "--example", example, "--json", str(out),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads(out.read_text())
    # The same keys as the reference job's demo.
    assert set(report) == {f.name for f in dataclasses.fields(DemoReport)}
    assert [m["kind"] for m in report["migrations"]] == ["drain", "failure", "straggler"]
    for m in report["migrations"]:
        assert set(m) == {f.name for f in dataclasses.fields(MigrationRow)}
        assert m["state"] == "done", m["detail"]
        # Measured from the ranks' step timelines (0 where the move cost less than one
        # normal step, as a loaded host's long steps make it: docs/glossary.md).
        assert m["downtime_s"] is not None and "downtime" in m["phases"]
    return report


def test_the_ddp_example_demo_moves_three_times_and_ends_bit_identical(tmp_path: Path) -> None:
    report = run_demo("ddp", tmp_path)
    drain, failure, straggler = report["migrations"]
    assert drain["leaver"] == "m0" and failure["leaver"] == drain["joiner"]
    assert straggler["leaver"] == "m1"
    assert report["bitexact"] is True and report["mismatches"] == []


def test_the_llama_example_demo_moves_three_times_and_ends_bit_identical(tmp_path: Path) -> None:
    """TP2 x HSDP(2x2): the killed machine's shards come from the other replica."""
    report = run_demo("llama", tmp_path)
    assert [m["leaver"] for m in report["migrations"]] == ["m1", "m2", "m3"]
    assert report["bitexact"] is True and report["mismatches"] == []


def test_an_unknown_example_is_refused_naming_the_known_ones() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trainmover.cli", "demo", "--example", "fsdp9"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "no example 'fsdp9'" in done.stderr and "ddp" in done.stderr
