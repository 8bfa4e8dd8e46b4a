"""A job's end brought forward (`advance {limit, last}`, what the sidecars' `finish` op
sends): every rank finishes after that step and saves its state where the config saves
its last one; a rank that already left that step's boundary refuses. Real processes: a
1 x 1 x 2 job held at a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmover.localjob import LocalJob
from trainmover.runtime import control as c
from trainmover.runtime import controlconn

from .conftest import DP2, WAIT_S

pytestmark = pytest.mark.timeout(300)

HELD, LAST, STEPS = 4, 6, 50
EARLY_CONFIG = DP2.with_updates(train={"steps": STEPS, "dump_steps": [STEPS]})


def test_a_job_ended_early_finishes_every_rank_there_with_its_last_dump(tmp_path: Path) -> None:
    with LocalJob.launch(EARLY_CONFIG, tmp_path, standbys=0, limit=HELD, timeout_s=WAIT_S) as job:
        job.wait_step(HELD, timeout_s=WAIT_S)
        ranks = job.ranks()
        with pytest.raises(controlconn.RemoteError, match="already past it"):
            job.control.request(ranks[0], c.Advance(limit=HELD - 1, last=True), WAIT_S)
        for ref in ranks:
            job.control.request(ref, c.Advance(limit=LAST, last=True), WAIT_S)
        job.tracker.wait(
            lambda: all(job.procs[r].poll() is not None for r in ranks), WAIT_S, "exits"
        )
        exits = {r: job.exited[r] for r in ranks}
    assert {(e.reason, e.step) for e in exits.values()} == {("finished", LAST)}
    saved = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert saved == [f"d0p0t0.step{LAST}.pt", f"d1p0t0.step{LAST}.pt"]
