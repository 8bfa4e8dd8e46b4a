"""A failure's joiner restored from a DP replica at a dump step does not save that step's
state: it holds the replica's RNGs, not the role's (the leaver saved the role's before it
died, or did not get that far). It marks the dump skipped instead, and a comparison with
an uninterrupted run does not count the missing file. Real processes: a 1 x 1 x 2 job,
one machine SIGKILLed right after its dump, or after the step and before its dump. (A
`LocalJob`'s machines share one state folder, where a second save of a file is skipped
anyway: the joiner's log says what it did; on separate machines, as in the e2e stack, it
would otherwise have saved its own copy.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmover.localjob import LocalJob
from trainmover.runtime.compare import mismatches, skip_marker, skipped_roles, state_files

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
    assert skip_marker(tmp_path / "state", "d1p0t0", DUMP).exists()


def test_a_step_whose_dump_died_with_its_rank_is_marked_skipped_not_missing(
    tmp_path: Path,
) -> None:
    config = DP2.with_updates(train={"steps": STEPS, "dump_steps": [DUMP, STEPS]})
    reference = tmp_path / "reference"
    with LocalJob.launch(config, reference, standbys=0, timeout_s=WAIT_S) as job:
        job.finish(timeout_s=WAIT_S)
    run = tmp_path / "run"
    fault = {"TM_TEST_FAULT": f"m1@{DUMP}:before-dump"}
    with LocalJob.launch(config, run, standbys=1, timeout_s=WAIT_S, extra_env=fault) as job:
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        report = job.recover(dead, detected_at=noticed, timeout_s=WAIT_S)
        job.finish(timeout_s=WAIT_S)
    assert dead == "m1" and report.step == DUMP  # it had committed the step, not saved it
    ours, theirs = state_files(run, DUMP), state_files(reference, DUMP)
    assert "d1p0t0" not in ours and "d1p0t0" in theirs  # nobody saved the role's state
    assert skipped_roles(run, DUMP) == {"d1p0t0"}
    assert mismatches(ours, theirs) == ["d1p0t0: saved by only one run"]
    assert mismatches(ours, theirs, skipped_roles(run, DUMP)) == []  # the rest is identical
    assert mismatches(state_files(run, STEPS), state_files(reference, STEPS)) == []
