"""The vote's share of the step inside a job, from the machines' step statistics (pure)."""

from __future__ import annotations

import pytest

from trainmover.bench.store_job import job_config, share
from trainmover.messages import StepStats


def stats(machine: str, step: int, ts: float, vote_s: float) -> StepStats:
    return StepStats(job="j", machine=machine, step=step, compute_s=0.05, vote_s=vote_s, ts=ts)


def test_the_vote_is_the_smallest_over_the_machines_and_the_step_their_gaps() -> None:
    # m1 arrives last at every step: its vote is the agreement's own cost; m0 waited for it.
    got = [
        stats("m0", 30, 10.0, 0.030), stats("m1", 30, 10.0, 0.002),
        stats("m0", 31, 10.1, 0.030), stats("m1", 31, 10.1, 0.004),
        stats("m0", 32, 10.2, 0.030), stats("m1", 32, 10.2, 0.003),
        stats("m0", 33, 10.4, 0.030),  # m1's statistics of step 33 never came: left out
    ]  # fmt: skip
    out = share(got)
    assert out["steps"] == 3
    assert out["vote_ms"] == pytest.approx(3.0)
    assert out["median_step_ms"] == pytest.approx(100.0)
    assert out["share_of_step"] == pytest.approx(0.03)
    assert out["vote"]["samples"] == pytest.approx([2.0, 4.0, 3.0])


def test_the_job_is_the_reference_job_at_the_size_on_machines_of_the_local_ranks() -> None:
    big = job_config(16, 4)
    assert (big.layout.tp, big.layout.pp, big.layout.dp) == (4, 2, 2)
    assert big.cluster.machines == ["m0", "m1", "m2", "m3"] and big.cluster.standbys == []
    one = job_config(4, 4)  # one machine's worth: no second stage to put anywhere
    assert (one.layout.tp, one.layout.pp, one.layout.dp) == (4, 1, 1)
