"""The torchft survivor's stall, from its step events (pure: no torchft processes)."""

from __future__ import annotations

import pytest

from trainmover.bench.torchft_peer import survivor_stall

NORMAL = 0.1


def steps(*ends: float, committed: bool = True) -> list[dict]:
    return [{"t": t, "committed": committed, "participants": 2} for t in ends]


def test_a_wait_after_the_step_in_flight_is_counted() -> None:
    # The step in flight at the kill ends on time (the victim had given its gradients);
    # the next one waits out a 5 s heartbeat timeout.
    span = steps(1.1, 6.2, 6.3)
    stall, lost = survivor_stall(span, last_before=1.0, normal=NORMAL)
    assert stall == pytest.approx(5.0)
    assert lost == pytest.approx(5.0)


def test_steps_that_did_not_commit_are_lost_time() -> None:
    span = [*steps(1.1, 1.2, committed=False), *steps(1.3)]
    stall, lost = survivor_stall(span, last_before=1.0, normal=NORMAL)
    assert stall == pytest.approx(0.0)
    assert lost == pytest.approx(0.2)


def test_an_undisturbed_survivor_lost_nothing() -> None:
    stall, lost = survivor_stall(steps(1.1, 1.2, 1.3), last_before=1.0, normal=NORMAL)
    assert (stall, lost) == (pytest.approx(0.0), pytest.approx(0.0))
