"""A machine's workers as its sidecar sees them: a plan for workers that have ended (the
job finished before the plan came) is refused at once, naming them, instead of waiting
out its timeout for a hello that will never come; workers relaunched as a standby (after
a fence or a maintenance) are welcomed without a role, even by a cluster state that
still names the machine active; every rank of a launch, a standby's too, is told the
vote store its local rank 0 serves, and no rank of a relaunch is told the last one's."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

import pytest

from tests.conftest import sample_state
from trainmover.messages import DrainEvent
from trainmover.runtime import control as c
from trainmover.runtime.config import JobConfig
from trainmover.services.planner.decisions import Planner
from trainmover.services.sidecar.workers import MachineWorkers

#: A worker that exits at once (these tests never let one say hello).
ENTRY = "tests.runtime.forked_entry"


def test_a_plan_for_finished_workers_is_refused_naming_them(tmp_path: Path) -> None:
    job = "ended"
    state = sample_state(job)
    (plan,) = Planner().on_event(state, DrainEvent(job=job, machine="m1"), time.time()).plans
    workers = MachineWorkers(
        "m0", JobConfig(job=job), tmp_path, "127.0.0.1:1", lambda: state, "unused.entry"
    )
    try:
        for ref in workers.refs:  # what each worker says as it leaves at the job's end
            workers.tracker.on_event(ref, c.Exited(reason="finished", step=150))
        with pytest.raises(RuntimeError, match="no live worker on m0 .*finished at step 150"):
            workers.prepare(plan, timeout_s=5)
        with pytest.raises(RuntimeError, match="no live worker on m0"):
            workers.recover(plan, timeout_s=5)
    finally:
        workers.control.close()


def test_workers_relaunched_as_a_standby_get_no_role_from_a_stale_state(tmp_path: Path) -> None:
    job = "relaunched"
    state = sample_state(job)  # m0 still active with its cell: not yet marked failed
    workers = MachineWorkers(
        "m0", JobConfig(job=job), tmp_path, "127.0.0.1:1", lambda: state, ENTRY
    )
    hello = c.Hello(machine="m0", local_rank=0, pid=1)
    try:
        assert workers.welcome(hello).role is not None  # a first start takes the role
        workers.launch(as_standby=True)
        welcome = workers.welcome(hello)
        assert welcome.role is None and welcome.groups == [] and welcome.store == ""
        workers.stop()
    finally:
        workers.close()


def test_every_rank_of_a_launch_is_welcomed_with_the_vote_store_its_local_rank_0_serves(
    tmp_path: Path,
) -> None:
    job = "tally"
    state = sample_state(job)
    workers = MachineWorkers(
        "s0", JobConfig(job=job), tmp_path, "127.0.0.1:1", lambda: state, ENTRY, timeout_s=30
    )
    try:
        # Local rank 1 says hello first: its welcome waits for local rank 0's.
        with ThreadPoolExecutor(1) as pool:
            early = pool.submit(workers.welcome, c.Hello(machine="s0", local_rank=1, pid=2))
            with pytest.raises(FuturesTimeout):  # still waiting for local rank 0
                early.result(timeout=0.3)
            first = workers.welcome(
                c.Hello(machine="s0", local_rank=0, pid=1, machine_store="127.0.0.1:4242")
            )
            second = early.result(timeout=30)
        assert first.role is None and second.role is None  # standbys are told it too
        assert first.machine_store == second.machine_store == "127.0.0.1:4242"
        assert first.launch == second.launch == workers.launch_id
        # A relaunch is a launch of its own: nothing of the last one's store is handed out.
        workers.launch(as_standby=True)
        workers.timeout_s = 0.2
        with pytest.raises(RuntimeError, match="local rank 0 of s0 said no hello .* launch"):
            workers.welcome(c.Hello(machine="s0", local_rank=1, pid=3))
        workers.stop()
    finally:
        workers.close()
