"""The per-step commit vote projected to a job of PROJECTED_RANKS ranks, from the votes
`trainmover bench store` measured and the job's store's calibrated CPU per voter.

The job's store serves its requests one after the other, so beyond the smallest round
the vote grows by the store's work for each further voter. A voter costs a store three
requests per step (its vote, its watcher's wait and read of the decision: the
calibrated `per_voter_ms`). With shards (`trainmover.runtime.shardvote`) a step's work
splits: each shard serves its voters (three requests each), in parallel with the other
shards, and the job's store serves the shards (five requests each: the claim, the vote,
the claim of the step before dropped, the relay's wait and read).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

PROJECTED_RANKS = 1024
#: Ranks per machine of the projected job (GPUs per machine).
PROJECTED_LOCAL = 8
#: Requests per voter and step in the store it votes in, and per shard in the job's.
VOTER_REQUESTS, SHARD_REQUESTS = 3, 5


def flat(rows: list[dict[str, Any]], mode: str, per_voter_ms: float) -> dict[str, float]:
    """`mode`'s vote at PROJECTED_RANKS on machines of PROJECTED_LOCAL: the smallest
    round's vote (its few voters' round trips) plus the calibrated store CPU for each
    further voter. Beside it, the old reading: the vote's wall time fitted against the
    ranks on this host (where 16 processes share 2 cores)."""
    projected_voters = PROJECTED_RANKS // (PROJECTED_LOCAL if mode == "machines" else 1)
    base = rows[0]
    at = base[f"{mode}_vote_ms"] + per_voter_ms * (projected_voters - base[f"{mode}_voters"])
    x = np.array([r["ranks"] for r in rows], dtype=float)
    y = np.array([r[f"{mode}_vote_ms"] for r in rows])
    b, a = np.polyfit(x, y, 1) if len(rows) > 1 else (0.0, float(y[0]))
    return {
        "store_cpu_ms_per_voter": per_voter_ms,
        "voters_at_1024": projected_voters,
        "at_1024_ms": float(at),
        "wall_fit_a_ms": float(a),
        "wall_fit_b_ms_per_rank": float(b),
        "wall_fit_at_1024_ms": float(a + b * PROJECTED_RANKS),
    }


def serial_requests(voters: int, shards: int) -> int:
    """Requests a step's vote puts on the busiest path: the fullest shard's voters, then
    the job's store's shards."""
    return VOTER_REQUESTS * math.ceil(voters / shards) + SHARD_REQUESTS * shards


def best_shards(voters: int) -> int:
    """The number of shards that makes `serial_requests` smallest for `voters`."""
    return min(range(1, voters + 1), key=lambda s: (serial_requests(voters, s), s))


def sharded(rows: list[dict[str, Any]], per_voter_ms: float) -> dict[str, float]:
    """The per-machine vote at PROJECTED_RANKS with `best_shards` shards: the smallest
    round's per-machine vote, plus the shards' extra level (measured: the sharded vote
    less the flat one at the smallest round, both a voter per rank), plus the store CPU
    of the busiest path beyond the smallest round's (`serial_requests`, each request a
    third of a voter's calibrated cost)."""
    voters = PROJECTED_RANKS // PROJECTED_LOCAL
    shards = best_shards(voters)
    base = rows[0]
    level_ms = base["sharded_vote_ms"] - base["trainmover_vote_ms"]
    per_request_ms = per_voter_ms / VOTER_REQUESTS
    beyond = serial_requests(voters, shards) - serial_requests(base["machines_voters"], 1)
    at = base["machines_vote_ms"] + max(level_ms, 0.0) + per_request_ms * beyond
    return {
        "voters_at_1024": voters,
        "shards_at_1024": shards,
        "level_ms": level_ms,
        "serial_requests_at_1024": serial_requests(voters, shards),
        "flat_requests_at_1024": VOTER_REQUESTS * voters,
        "at_1024_ms": float(at),
    }
