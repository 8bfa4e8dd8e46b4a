"""A plan for a machine whose workers have ended (the job finished before the plan came)
is refused at once, naming them, instead of waiting out its timeout for a hello that
will never come."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import sample_state
from trainmover.messages import DrainEvent
from trainmover.runtime import control as c
from trainmover.runtime.config import JobConfig
from trainmover.services.planner.decisions import Planner
from trainmover.services.sidecar.workers import MachineWorkers


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
