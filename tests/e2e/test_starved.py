"""A machine starved of a CPU is not moved; a stopped one is (tests/e2e/test_hangs.py).

Both worker processes of m1 are put in a CPU cgroup of their own with a quota of 1 ms of
CPU per second (a container at its CPU limit, throttled): their threads stay runnable
but do not run, and their ranks stop beating on the progress board as a stopped
process's do. The voters waiting on m1 name it silent; m1's sidecar, outside the quota,
reads its workers runnable and not running and says so in its heartbeats, and the health
monitor excuses m1 instead of declaring it failed (a standby is warm, so a failure would
move it). With the quota lifted, m1 trains on in its place and nothing has moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import CONFIG, WAIT_S, failures_of
from trainmover.localcluster import LocalCluster

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")


def _own_cpu_cgroup() -> Path:
    """This process's cgroup of the (v1) cpu controller."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return CPU_CGROUPS / path.lstrip("/")
    raise FileNotFoundError("no cpu controller in /proc/self/cgroup")


@contextlib.contextmanager
def _throttled(pids: list[int]) -> Iterator[None]:
    """Every thread of `pids` gets 1 ms of CPU per second while inside."""
    home = _own_cpu_cgroup()
    cage = home / f"trainmover-test-starved-{os.getpid()}"
    cage.mkdir()
    try:
        (cage / "cpu.cfs_period_us").write_text("1000000")
        (cage / "cpu.cfs_quota_us").write_text("1000")
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(ProcessLookupError):  # a thread that ended
                    (cage / "tasks").write_text(tid)
        yield
    finally:
        for tid in (cage / "tasks").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                (home / "tasks").write_text(tid)
        cage.rmdir()


def _excused(log: Path, machine: str) -> int:
    if not log.exists():
        return 0
    lines = log.read_text(errors="replace").splitlines()
    return sum('"stall_excused"' in x and f'"machine": "{machine}"' in x for x in lines)


@pytest.fixture
def cgroups() -> None:
    try:
        writable = os.access(_own_cpu_cgroup(), os.W_OK)
    except (OSError, ValueError):
        writable = False
    if not writable:
        pytest.skip("throttling a process needs a writable cgroup (v1) cpu controller")


async def test_a_machine_starved_of_a_cpu_is_excused_not_moved(
    tmp_path: Path, cgroups: None
) -> None:
    logs = tmp_path / "logs"
    async with LocalCluster(CONFIG, tmp_path / "job", log_dir=logs) as cluster:
        await cluster.wait_step("m1", 10, WAIT_S)
        # Held meanwhile: on a loaded box the standbys took longer to warm than the
        # whole job took to train, and a finished job has no workers to throttle.
        await cluster.hold(WAIT_S)
        await cluster.wait_standbys_warm(WAIT_S)
        pids = await cluster.worker_pids("m1", WAIT_S)
        await cluster.release(WAIT_S)
        async with failures_of(cluster) as failures:
            with _throttled(pids):
                async with asyncio.timeout(120):
                    # A log file has no change event to await.
                    while _excused(logs / "health-monitor.log", "m1") == 0:  # noqa: ASYNC110
                        await asyncio.sleep(0.2)
            now = max(cluster.steps.values())
            await cluster.wait_step("m1", now + 5, WAIT_S)
        assert failures == [], failures
        state = await cluster.wait_state(lambda s: not s.in_flight, WAIT_S)
        assert state.machines["m1"].status == "active"
        assert all(m.status != "failed" for m in state.machines.values())
