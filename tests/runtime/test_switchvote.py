"""The switch agreement against a real rendezvous store (a TCPStore in this process):
one decision per (plan, k), "switch" only when every committer took k."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from trainmover.runtime.layout import Layout
from trainmover.runtime.plan import compute_delta
from trainmover.runtime.storeclient import Store
from trainmover.runtime.switchvote import DROP, SWITCH, SwitchVote
from trainmover.runtime.tcpstore import serve

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield serve("127.0.0.1")


def _vote(store: dist.TCPStore, plan_id: str = "p1") -> SwitchVote:
    def client() -> Store:
        return Store(f"127.0.0.1:{store.port}", 60)

    return SwitchVote("j", plan_id, client)


def _decided(vote: SwitchVote, step: int) -> str | None:
    return vote.decision(step, keep_waiting=lambda: False, timeout_s=60)


def test_the_last_committer_to_take_k_decides_switch(store: dist.TCPStore) -> None:
    vote = _vote(store)
    vote.accept(5, committers=3)
    vote.accept(5, committers=3)
    assert _decided(vote, 5) is None  # one committer has not answered yet
    vote.accept(5, committers=3)
    assert _decided(vote, 5) == SWITCH


@pytest.mark.parametrize("refused_after", [0, 1, 2])
def test_one_refusal_drops_k_whenever_it_comes(store: dist.TCPStore, refused_after: int) -> None:
    vote = _vote(store)
    for _ in range(refused_after):
        vote.accept(5, committers=3)
    vote.refuse(5)
    for _ in range(2 - refused_after):
        vote.accept(5, committers=3)
    assert _decided(vote, 5) == DROP


def test_decisions_are_per_plan_and_step(store: dist.TCPStore) -> None:
    vote, other = _vote(store), _vote(store, "p2")
    vote.refuse(5)
    vote.accept(7, committers=1)
    other.accept(5, committers=1)
    assert (_decided(vote, 5), _decided(vote, 7), _decided(other, 5)) == (DROP, SWITCH, SWITCH)


def test_a_rank_at_k_waits_for_the_decision(store: dist.TCPStore) -> None:
    vote = _vote(store)
    vote.accept(5, committers=2)
    got: list[str | None] = []
    waiter = threading.Thread(
        target=lambda: got.append(vote.decision(5, keep_waiting=lambda: True, timeout_s=60))
    )
    waiter.start()
    vote.accept(5, committers=2)
    waiter.join(30)
    assert got == [SWITCH]


def test_a_wait_that_should_end_ends_undecided(store: dist.TCPStore) -> None:
    stop = threading.Event()
    got: list[str | None] = []
    vote = _vote(store)
    waiter = threading.Thread(
        target=lambda: got.append(vote.decision(5, lambda: not stop.is_set(), timeout_s=60))
    )
    waiter.start()
    stop.set()  # a recovery came, or k was replaced
    waiter.join(30)
    assert got == [None]
    vote.accept(5, committers=1)
    assert _decided(vote, 5) == SWITCH  # nothing was decided by the wait that ended


def test_a_committer_that_never_answers_drops_k_at_the_timeout(store: dist.TCPStore) -> None:
    vote = _vote(store)
    vote.accept(5, committers=2)
    assert vote.decision(5, keep_waiting=lambda: True, timeout_s=0.1) == DROP
    vote.accept(5, committers=2)  # too late: the decision stands
    assert _decided(vote, 5) == DROP


def test_committers_are_the_delta_and_transfer_members_but_the_joiners() -> None:
    layout = Layout(tp=2, pp=1, dp=2)
    plan = compute_delta(
        job="j",
        plan_id="p1",
        layout=layout,
        assignment={"m0": layout.cells()[0], "m1": layout.cells()[1]},
        generations=dict.fromkeys(layout.all_groups(), 0),
        moves={"m0": "s0"},
    )
    assert [str(r) for r in plan.committers()] == ["m0/0", "m0/1", "m1/0", "m1/1"]
