"""The local harness never holds a job short of a switch step it committed to."""

from __future__ import annotations

from pathlib import Path

from tests.runtime.test_world import CONFIG, ENTRY, WAIT_S
from trainmover.localjob import LocalJob


def test_a_held_job_is_let_run_to_the_switch_step_the_executor_picks(tmp_path: Path) -> None:
    # Phase 1 can outlast the steps a hold leaves (a loaded host): the executor then
    # picks a switch step past the hold, which the job must be let reach.
    config = CONFIG.with_updates(
        layout={"dp": 2, "pp": 1}, cluster={"machines": ["m0", "m1"]}, train={"steps": 8}
    )
    env = {"TM_TEST_WORLD": "0"}
    with LocalJob.launch(
        config, tmp_path, standbys=1, entry=ENTRY, timeout_s=WAIT_S, limit=2, extra_env=env
    ) as job:
        job.wait_step(2)
        report = job.migrate({"m0": "s0"}, margin=2)
        assert report.commit_step > 2  # past the hold
        assert job.limit == report.commit_step + 1
        job.set_limit(config.train.steps)
        job.finish(timeout_s=WAIT_S)
    assert {r.machine for r in report.switched} == {"m0", "m1", "s0"}
    assert job.losses().keys() == set(range(1, 9))
