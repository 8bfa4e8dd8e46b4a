"""A failure's joiner restored from a DP replica at a dump step does not save that step's
state: it holds the replica's RNGs, not the role's (the leaver saved the role's before it
died). Real processes: a 1 x 1 x 2 job, one machine SIGKILLed right after its dump. (A
`LocalJob`'s machines share one state folder, where a second save of a file is skipped
anyway: the joiner's log says what it did; on separate machines, as in the e2e stack, it
would otherwise have saved its own copy.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmover.localjob import LocalJob

from .conftest import DP2, WAIT_S, worker_events

pytestmark = pytest.mark.timeout(600)

DUMP, STEPS = 4, 8


def test_the_step_a_joiner_took_from_a_replica_is_saved_by_the_leaver_only(
    tmp_path: Path,
) -> None:
    config = DP2.with_updates(train={"steps": STEPS, "dump_steps": [DUMP, STEPS]})
    fault = {"TM_TEST_FAULT": f"m1@{DUMP}:after-dump"}
    with LocalJob.launch(config, tmp_path, standbys=1, timeout_s=WAIT_S, extra_env=fault) as job:
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        report = job.recover(dead, detected_at=noticed, timeout_s=WAIT_S)
        job.finish(timeout_s=WAIT_S)
    assert dead == "m1"
    assert report.step == DUMP  # the killed machine had committed it: nothing re-executed
    joiner = report.plan.moves[0].joiner
    killed_at = json.loads((tmp_path / "faults.jsonl").read_text().splitlines()[0])["t"]
    saved = (tmp_path / "state" / f"d1p0t0.step{DUMP}.pt").stat().st_mtime
    assert saved <= killed_at  # the leaver's, written before it died
    joiner_log = tmp_path / "logs" / f"{joiner}-0.log"
    skipped = [e["step"] for e in worker_events(joiner_log, "dump_skipped")]
    assert skipped == [DUMP]
    assert (tmp_path / "state" / f"d1p0t0.step{STEPS}.pt").exists()  # trained on, saved
