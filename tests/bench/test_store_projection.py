"""The commit vote's projection to a large job (`bench/store_projection`), pure."""

from __future__ import annotations

import pytest

from trainmover.bench.store_projection import best_shards, serial_requests, sharded


@pytest.mark.parametrize("voters", [1, 2, 16, 128, 1000])
def test_the_best_number_of_shards_puts_the_fewest_requests_on_the_busiest_path(
    voters: int,
) -> None:
    best = best_shards(voters)
    assert 1 <= best <= voters
    assert all(
        serial_requests(voters, best) <= serial_requests(voters, s) for s in range(1, voters + 1)
    )


def test_shards_take_most_of_a_large_jobs_requests_off_the_busiest_path() -> None:
    # 128 machines: 8 shards of 16, three requests a voter, five a shard in the job's store.
    assert best_shards(128) == 8 and serial_requests(128, 8) == 3 * 16 + 5 * 8
    assert serial_requests(128, 1) == 3 * 128 + 5


def test_the_projection_adds_the_shards_level_and_the_busiest_paths_requests() -> None:
    row = {"ranks": 4, "machines_vote_ms": 1.0, "machines_voters": 1, "trainmover_vote_ms": 0.5,
           "sharded_vote_ms": 0.75}  # fmt: skip
    projected = sharded([row], per_voter_ms=0.03)
    extra = serial_requests(128, 8) - serial_requests(1, 1)
    assert projected["at_1024_ms"] == pytest.approx(1.0 + 0.25 + 0.01 * extra)
    # A shards' level measured below zero (noise at the smallest round) adds nothing.
    projected = sharded([{**row, "sharded_vote_ms": 0.4}], per_voter_ms=0.03)
    assert projected["level_ms"] == pytest.approx(-0.1)
    assert projected["at_1024_ms"] == pytest.approx(1.0 + 0.01 * extra)
