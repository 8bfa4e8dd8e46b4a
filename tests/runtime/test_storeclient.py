"""The rendezvous store's replicas and its clients' failover, on real TCPStores in this
process: a standby takes over when the serving replica goes, every client's share is
re-cast into it, and a decision seen before the loss is never displaced after it.
Each `Share` stands for one process (a rank keeps one per store)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from trainmover.freeports import free_ports
from trainmover.runtime.rendezvous import POLL_S, TAKEOVER_S, RendezvousHost
from trainmover.runtime.storeclient import Share, Store, StoreLost
from trainmover.runtime.storelook import SERVING, STANDBY, UNKNOWN, probe

pytestmark = pytest.mark.timeout(120)


class Replicas:
    """The job's store as `n` replicas on fixed ports, each startable and stoppable."""

    def __init__(self, n: int):
        self.ports = free_ports(n)
        self.address = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.hosts: dict[int, RendezvousHost] = {}

    def start(self, i: int) -> RendezvousHost:
        peers = [f"127.0.0.1:{p}" for j, p in enumerate(self.ports) if j != i]
        self.hosts[i] = RendezvousHost(port=self.ports[i], peers=peers, index=i)
        return self.hosts[i]

    def stop(self, i: int) -> None:
        self.hosts.pop(i).close()

    def role(self, i: int, tries: int = 6) -> str | None:
        """The role replica `i` names; asked again while it listens without answering
        in time (UNKNOWN: a server a loaded host stalls for seconds, not a role)."""
        for _ in range(tries):
            seen = probe("127.0.0.1", self.ports[i])
            if seen is None or seen[0] != UNKNOWN:
                break
        return None if seen is None else seen[0]

    def client(self, timeout_s: float = 30.0) -> Store:
        """A client with a share of its own: another process."""
        return Store(self.address, timeout_s, share=Share(self.address))


def _serving(host: RendezvousHost, timeout_s: float = 10.0) -> None:
    assert host.promoted.wait(timeout_s), "the replica never started serving"


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    r = Replicas(2)
    yield r
    for i in list(r.hosts):
        r.stop(i)


#: Rounds of a standby's watch that last longer than a takeover (each waits POLL_S).
_SPANNING_TAKEOVER = math.ceil(TAKEOVER_S / POLL_S) + 2


def test_the_first_replica_serves_and_the_other_stands_by(replicas: Replicas) -> None:
    first, second = replicas.start(0), replicas.start(1)
    _serving(first)
    assert replicas.role(0) == SERVING
    assert second.wait_rounds(_SPANNING_TAKEOVER, 60)  # it must not take over meanwhile
    assert replicas.role(1) == STANDBY and not second.promoted.is_set()
    store = replicas.client()
    store.set("k", "v")
    assert store.share.incarnation == first.incarnation


def test_a_counted_decision_is_made_after_the_serving_replica_is_lost(
    replicas: Replicas,
) -> None:
    first, second = replicas.start(0), replicas.start(1)
    _serving(first)
    voters = [replicas.client() for _ in range(3)]
    assert voters[0].vote("s/votes", 3, "s/decision", "commit") == 1
    assert voters[1].vote("s/votes", 3, "s/decision", "commit") == 2
    replicas.stop(0)
    # The third vote reaches the standby once it has taken over; the first two voters
    # re-cast theirs at their next operation, and the last to do so decides.
    assert voters[2].vote("s/votes", 3, "s/decision", "commit") == 1
    _serving(second)
    assert not voters[2].check(["s/decision"])
    waits = [
        threading.Thread(target=v.wait, args=(["s/decision"], timedelta(seconds=30)))
        for v in voters[:2]
    ]
    for t in waits:
        t.start()
    for t in waits:
        t.join(60)
    assert [v.get("s/decision") for v in voters] == [b"commit"] * 3
    assert {v.share.incarnation for v in voters} == {second.incarnation}
    assert voters[0].count("s/votes") == 3  # each vote counted once in the new incarnation


def test_a_decision_seen_before_the_loss_is_never_displaced(replicas: Replicas) -> None:
    first, second = replicas.start(0), replicas.start(1)
    _serving(first)
    voters = [replicas.client() for _ in range(3)]
    for v in voters:
        v.vote("s/votes", 4, "s/decision", "commit")
    # An abort wins before the fourth vote, and one voter reads it.
    assert voters[0].compare_set("s/decision", "", "abort") == b"abort"
    replicas.stop(0)
    _serving(second)
    fourth = replicas.client()
    # In the new incarnation the fourth vote would reach the threshold once every other
    # vote is re-cast; the abort is re-cast before the vote that carries it there.
    assert fourth.vote("s/votes", 4, "s/decision", "commit") == 1
    for v in voters:
        assert v.get("s/decision") == b"abort"
    assert fourth.get("s/decision") == b"abort"
    assert fourth.count("s/votes") == 4


def test_a_peeked_decision_is_kept_through_the_loss_like_one_read(replicas: Replicas) -> None:
    first, second = replicas.start(0), replicas.start(1)
    _serving(first)
    watcher, voter = replicas.client(), replicas.client()
    assert watcher.peek("s/decision") is None  # a peek waits for nothing, creates nothing
    assert watcher.check(["s/decision"]) is False
    voter.compare_set("s/decision", "", "abort")
    assert watcher.peek("s/decision") == b"abort"
    voter.forget("s/")  # only the watcher's share holds the decision now
    replicas.stop(0)
    _serving(second)
    assert watcher.count("s/other") == 0  # its first operation there re-casts its share
    late = replicas.client()
    assert late.compare_set("s/decision", "", "commit") == b"abort"


def test_replicas_started_together_take_over_in_the_jobs_order(replicas: Replicas) -> None:
    # The later one up first: the first one finds it alive, yet neither has seen one
    # serve, so the job's order decides.
    second = replicas.start(1)
    first = replicas.start(0)
    _serving(first)
    assert second.wait_rounds(_SPANNING_TAKEOVER, 60)
    assert not second.promoted.is_set() and replicas.role(1) == STANDBY


def test_a_restarted_replica_comes_back_a_standby(replicas: Replicas) -> None:
    first, second = replicas.start(0), replicas.start(1)
    _serving(first)
    store = replicas.client()
    store.set("before", "1")
    replicas.stop(0)
    _serving(second)
    assert store.get("before") == b"1"  # moved, and re-cast what it had written
    again = replicas.start(0)
    assert again.wait_rounds(_SPANNING_TAKEOVER, 60)  # it sees the other serve: stays standby
    assert replicas.role(0) == STANDBY and not again.promoted.is_set()
    store.set("after", "2")
    assert store.share.incarnation == second.incarnation
    assert replicas.client().get("after") == b"2"


def test_a_replica_restarted_unnoticed_is_not_used_until_the_process_moves(
    replicas: Replicas,
) -> None:
    first, second = replicas.start(0), replicas.start(1)
    _serving(first)
    store = replicas.client()
    store.set("before", "1")
    replicas.stop(0)
    _serving(second)
    again = replicas.start(0)  # back on its port, as a standby, before this process noticed
    # A new client of this process checks the incarnation it reaches: the standby on
    # the old address is not it, so the process moves to the one serving.
    fresh = Store(replicas.address, 30, share=store.share)
    assert fresh.get("before") == b"1"
    assert store.share.incarnation == second.incarnation
    assert again.wait_rounds(2, 60) and replicas.role(0) == STANDBY


def test_the_standby_that_stayed_takes_over_before_a_restarted_earlier_one(
    replicas: Replicas,
) -> None:
    first, second = replicas.start(0), replicas.start(1)
    _serving(first)
    assert second.wait_rounds(2, 60)  # it has stood by the serving one
    store = replicas.client()
    store.set("before", "1")
    replicas.stop(0)
    # Back before the standby's takeover: earlier in the job's order, but a newcomer
    # (the clients' spare connections are to the standby that stayed).
    again = replicas.start(0)
    _serving(second)
    assert again.wait_rounds(_SPANNING_TAKEOVER, 60)
    assert not again.promoted.is_set() and not second.demoted.is_set()
    assert replicas.role(0) == STANDBY  # it stood by one serving: a standby like any
    assert store.get("before") == b"1"
    assert store.share.incarnation == second.incarnation


def _move_away(client: Store, incarnation: str | None) -> None:
    """Tells `client` its replica was lost until it uses another one. Both serve, so a
    move can land back on the same one when the other's look times out on a loaded host."""
    deadline = time.monotonic() + 60
    while client.share.incarnation == incarnation:
        assert time.monotonic() < deadline, f"never moved away from {incarnation}"
        client.share.lost(client.share.generation, time.monotonic() + 10)


def test_a_vote_is_never_cast_twice_into_one_incarnation() -> None:
    r = Replicas(2)
    try:
        # Both serve (two sides of a partition): a process may move there and back.
        r.hosts = {i: RendezvousHost(port=port) for i, port in enumerate(r.ports)}
        voter = r.client()
        voter.vote("s/votes", 5, "s/decision", "commit")
        first = voter.share.incarnation
        _move_away(voter, first)
        _move_away(voter, voter.share.incarnation)
        # Where it voted first is either replica: a look at the first one may wait out
        # the resolver, and the client then starts at the other.
        assert first in {h.incarnation for h in r.hosts.values()}
        assert voter.share.incarnation == first
        assert voter.count("s/votes") == 1  # back where it voted first: not again
        _move_away(voter, first)
        assert voter.count("s/votes") == 1  # and its re-cast into the other was once
    finally:
        for i in list(r.hosts):
            r.stop(i)


def test_of_two_serving_replicas_the_later_steps_down() -> None:
    r = Replicas(2)
    try:
        # The second starts while the first is away, and takes over...
        second = r.start(1)
        _serving(second)
        # ...then the first comes back serving (as after a partition: it never saw it).
        r.hosts[0] = RendezvousHost(port=r.ports[0])
        assert second.demoted.wait(10)
        assert r.role(0) == SERVING
    finally:
        for i in list(r.hosts):
            r.stop(i)


def test_no_serving_replica_is_a_clear_error() -> None:
    r = Replicas(2)  # nothing listens
    with pytest.raises(StoreLost, match="no replica of the rendezvous store"):
        r.client(timeout_s=0.5).get("k")


def test_forget_bounds_a_share() -> None:
    share = Share("127.0.0.1:1")
    share.fact("job/commit/e0/1/decision", "commit", 0, 0.0)
    share.fact("job/commit/e0/10/decision", "commit", 0, 0.0)
    share.forget("job/commit/e0/1/")
    assert share.size() == 1
