"""The `trainmover` CLI as a user runs it: real processes, real bus, error paths."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import register_job, sample_state
from trainmover import bus
from trainmover.messages import MigrationProgress
from trainmover.subjects import JobSubjects


def run_cli(*args: str, url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainmover.cli", "--log-format", "json"]
    if url:
        cmd += ["--nats-url", url]
    return subprocess.run(
        cmd + list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )


def status_tables(text: str) -> dict[str, list[list[str]]]:
    """The tables of `trainmover status` output: title -> rows (header first) of cells
    (columns are separated by two or more spaces)."""
    tables: dict[str, list[list[str]]] = {}
    rows: list[list[str]] | None = None
    for line in text.splitlines():
        if not line.strip() or set(line.strip()) == {"─"}:
            continue
        if not line.startswith(" "):  # a title at the margin; rows are indented
            rows = tables.setdefault(line.strip(), []) if not line.startswith("job ") else None
            continue
        if rows is not None:
            rows.append(re.split(r"\s{2,}", line.strip()))
    return tables


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors and text in errors[-1], proc.stderr


def test_version():
    proc = run_cli("version")
    assert proc.returncode == 0 and proc.stdout.startswith("trainmover ")


def test_bad_url_is_one_line():
    assert_one_line_error(
        run_cli("status", "job1", url="nats://127.0.0.1:1"),
        1,
        "cannot reach NATS at nats://127.0.0.1:1",
    )


def test_missing_url_is_one_line():
    assert_one_line_error(run_cli("drain", "job1", "m0"), 1, "no NATS URL")


def test_invalid_names_are_rejected_before_connecting():
    assert_one_line_error(
        run_cli("drain", "job1", "m0.*", url="nats://127.0.0.1:1"), 2, "invalid machine name"
    )


def test_unknown_service():
    proc = run_cli("service", "scheduler")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.parametrize("deadline", ["-3", "soon"])
def test_invalid_deadline(nats_url, deadline):
    proc = run_cli("drain", "job1", "m0", "--deadline", deadline, url=nats_url)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


async def test_unknown_job_and_machine(nc, job, nats_url):
    assert_one_line_error(run_cli("status", job, url=nats_url), 1, f"unknown job '{job}'")
    await register_job(nc, job)
    assert_one_line_error(run_cli("drain", job, "m7", url=nats_url), 1, "unknown machine 'm7'")


async def test_drain_status_and_watch(nc, job, nats_url):
    await register_job(nc, job)
    drained = run_cli("drain", job, "m2", "--reason", "bios", "--deadline", "60", url=nats_url)
    assert drained.returncode == 0, drained.stderr
    event_id = drained.stdout.strip()
    watched = run_cli("watch", job, "--from-start", "--json", "--count", "1", url=nats_url)
    assert watched.returncode == 0, watched.stderr
    event = json.loads(watched.stdout)
    assert event["event_id"] == event_id and event["kind"] == "drain"
    assert event["deadline_s"] == 60
    status = run_cli("status", job, url=nats_url)
    assert status.returncode == 0 and "TP2 x PP2 x DP2" in status.stdout
    # Commands a person runs log at warning by default: no bus client info lines.
    assert "nats_connected" not in drained.stderr + watched.stderr + status.stderr
    verbose = run_cli("--log-level", "info", "status", job, url=nats_url)
    assert "nats_connected" in verbose.stderr
    assert "s0" in status.stdout and "standby" in status.stdout
    as_json = json.loads(run_cli("status", job, "--json", url=nats_url).stdout)
    assert sorted(as_json["state"]["machines"]) == ["m0", "m1", "m2", "m3", "s0"]
    assert as_json["migrations"] == []


async def test_status_lists_migrations_with_their_phase_and_downtime(nc, job, nats_url):
    await register_job(nc, job)
    js = nc.jetstream()
    for state, downtime in (("phase1", None), ("done", 0.125)):
        await bus.publish_durable(
            js,
            JobSubjects(job).progress,
            MigrationProgress(
                job=job,
                event_id="e-drain-m2",
                plan_id="p1",
                state=state,
                leaver="m2",
                joiner="s0",
                downtime_s=downtime,
                detail="m2 -> s0 at step 40",
            ),
        )
    await bus.publish_durable(
        js,
        JobSubjects(job).progress,
        MigrationProgress(
            job=job,
            event_id="e-fail-m1",
            plan_id="p2",
            state="recovering",
            leaver="m1",
            joiner="s1",
        ),
    )
    shown = run_cli("status", job, url=nats_url)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b[" not in shown.stdout  # no colour codes into a pipe
    tables = status_tables(shown.stdout)
    assert list(tables) == ["machines", "standbys", "in flight", "last migrations"]
    assert tables["machines"][0] == ["machine", "status", "role (dp, pp)", "role type"]
    assert ["m0", "active", "dp0 pp0", "first"] in tables["machines"]
    assert ["s0", "standby", "first, last"] in tables["standbys"]
    # In flight with its phase; ended with its downtime.
    assert ["e-fail-m1", "-", "m1 -> s1", "recovering", "-", "p2"] in tables["in flight"]
    assert ["e-drain-m2", "m2 -> s0", "done", "0.125 s", "m2 -> s0 at step 40"] in tables[
        "last migrations"
    ]
    as_json = json.loads(run_cli("status", job, "--json", url=nats_url).stdout)
    assert [m["state"] for m in as_json["migrations"]] == ["done", "recovering"]


async def test_status_of_a_large_job_counts_its_machines_and_names_those_not_active(
    nc, job, nats_url
):
    state = sample_state(job, machines=200, standbys=70)
    changes = {
        "m5": {"status": "leaving"},
        "m7": {"status": "failed"},
        "s3": {"warm_role_types": []},
    }
    machines = {n: m.model_copy(update=changes.get(n, {})) for n, m in state.machines.items()}
    state = state.model_copy(update={"machines": machines})
    await register_job(nc, job, state)
    shown = run_cli("status", job, url=nats_url)
    assert shown.returncode == 0, shown.stderr
    tables = status_tables(shown.stdout)
    assert tables["machines"][0] == ["machines", "status", "role type"]
    assert sorted(tables["machines"][1:]) == sorted(
        [["100", "active", "first"], ["98", "active", "last"], ["1", "failed", "last"],
         ["1", "leaving", "last"]]
    )  # fmt: skip
    assert tables["not active"][1:] == [["m5", "leaving", "dp2 pp1"], ["m7", "failed", "dp3 pp1"]]
    assert sorted(tables["standbys"][1:]) == [
        ["1", "standby", "cold"],
        ["69", "standby", "first, last"],
    ]
    assert "270 machines counted, not listed: --all lists each" in shown.stdout
    listed = status_tables(run_cli("status", job, "--all", url=nats_url).stdout)
    assert len(listed["machines"]) == 1 + 200 and len(listed["standbys"]) == 1 + 70
    assert ["m5", "leaving", "dp2 pp1", "last"] in listed["machines"]
    assert "not active" not in listed


def test_up_starts_the_bus_and_stops_on_ctrl_c(tmp_path):
    import signal

    from trainmover.natsserver import port_open

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainmover.cli",
            "--log-format",
            "json",
            "up",
            "--store-dir",
            str(tmp_path / "js"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    try:
        line = proc.stdout.readline()  # blocks until the stack is up
        assert line.startswith("export TRAINMOVER_NATS_URL=nats://127.0.0.1:")
        port = int(line.strip().rsplit(":", 1)[1])
        assert port_open("127.0.0.1", port)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not port_open("127.0.0.1", port)
        assert (tmp_path / "js").exists()  # a given state directory is kept
    finally:
        proc.kill()
