"""Workers forked from the fork server behave as processes started cold: the same exit
codes, output in their log, process groups, random numbers of their own."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from trainmover.runtime.forkserver import ForkServer
from trainmover.runtime.launcher import worker_env

ENTRY = "tests.runtime.forked_entry"


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    fork = ForkServer(tmp_path / "forkserver.log", worker_env())
    yield fork
    fork.close()


def _spawn(server: ForkServer, tmp_path: Path, mode: str, pgid: int | None = None):  # type: ignore[no-untyped-def]
    log = tmp_path / f"{mode}.log"
    return server.spawn(ENTRY, {"FORK_TEST_MODE": mode}, log, pgid), log


def test_exit_codes_output_and_one_thread(server: ForkServer, tmp_path: Path) -> None:
    done, done_log = _spawn(server, tmp_path, "done")
    three, _ = _spawn(server, tmp_path, "exit3")
    failed, failed_log = _spawn(server, tmp_path, "raise")
    assert (done.wait(60), three.wait(60), failed.wait(60)) == (0, 3, 1)
    assert done.poll() == 0
    assert "entry done" in done_log.read_text() and "threads=1" in done_log.read_text()
    assert "ValueError: the entry failed" in failed_log.read_text()


def test_kill_a_wait_that_times_out_and_process_groups(server: ForkServer, tmp_path: Path) -> None:
    first, first_log = _spawn(server, tmp_path, "sleep", pgid=0)
    second, _ = _spawn(server, tmp_path, "sleep", pgid=first.pid)
    assert os.getpgid(first.pid) == first.pid and os.getpgid(second.pid) == first.pid
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(0.2)
    assert first.poll() is None
    os.killpg(first.pid, signal.SIGKILL)  # a machine killed as a whole
    assert (first.wait(60), second.wait(60)) == (-signal.SIGKILL, -signal.SIGKILL)
    assert f"pgid={first.pid}" in first_log.read_text()


def test_forked_workers_draw_their_own_random_numbers_as_cold_ones_do(
    server: ForkServer, tmp_path: Path
) -> None:
    # A process started cold seeds torch from the OS: two of them draw apart.
    draws = []
    for name in ("a", "b"):
        worker = server.spawn(ENTRY, {"FORK_TEST_MODE": "rand"}, tmp_path / f"{name}.log", None)
        assert worker.wait(60) == 0
        text = (tmp_path / f"{name}.log").read_text()
        draws.append(next(line for line in text.splitlines() if line.startswith("rand")))
    assert draws[0] != draws[1]


def test_workers_outlive_a_dead_server_and_are_still_seen_to_exit(
    server: ForkServer, tmp_path: Path
) -> None:
    worker, _ = _spawn(server, tmp_path, "sleep")
    server.close()  # nobody reaps or reports for it now
    assert worker.poll() is None
    worker.kill()
    assert worker.wait(60) == -signal.SIGKILL
    # The server comes back for the next worker.
    again, _ = _spawn(server, tmp_path, "exit3")
    assert again.wait(60) == 3
