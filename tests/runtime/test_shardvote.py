"""The commit vote over the store's shards (`shardvote`): ranks as threads with their
own clients, the job's store and its shards as real TCPStores of a `RendezvousHost`
(replicated where a test loses one)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.runtime.votes import vote_all
from trainmover.freeports import free_port_block
from trainmover.runtime.abort import AbortSignal
from trainmover.runtime.agreement import CommitAgreement
from trainmover.runtime.rendezvous import RendezvousHost
from trainmover.runtime.shardvote import SHARDS_KEY, ShardVote, members, shard_of
from trainmover.runtime.storeclient import Share, Store

pytestmark = pytest.mark.timeout(120)

RANKS, SHARDS = 6, 2


def _client(address: str) -> dist.TCPStore:
    host, _, port = address.partition(",")[0].rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))


def _ranks(address: str, n: int = RANKS) -> list[CommitAgreement]:
    return [
        CommitAgreement(address, "job", n, AbortSignal("e0"), 0, timeout_s=30, rank=r)
        for r in range(n)
    ]


@pytest.fixture
def host() -> Iterator[RendezvousHost]:
    h = RendezvousHost(shards=SHARDS)
    yield h
    h.close()


@pytest.mark.parametrize("voters,shards", [(6, 2), (7, 3), (128, 11), (5, 5)])
def test_shards_split_the_voters_into_contiguous_runs_of_near_equal_size(
    voters: int, shards: int
) -> None:
    runs = [members(s, voters, shards) for s in range(shards)]
    assert [v for run in runs for v in run] == list(range(voters))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    assert all(shard_of(v, voters, shards) == s for s, run in enumerate(runs) for v in run)


def test_more_shards_than_voters_is_refused(host: RendezvousHost) -> None:
    with pytest.raises(ValueError, match="2 store shards for 1 voters"):
        ShardVote(host.shards, 0, 1, 30, relays=True)


def test_the_job_store_names_its_shards_and_counts_one_vote_per_shard(
    host: RendezvousHost,
) -> None:
    assert _client(host.address).get(SHARDS_KEY).decode() == ";".join(host.shards)
    ranks = _ranks(host.address)
    assert [(r.shard.index, r.shard.relays) for r in ranks if r.shard] == [
        (0, True), (0, False), (0, False), (1, True), (1, False), (1, False)
    ]  # fmt: skip
    assert vote_all(ranks, 1) == ["commit"] * RANKS
    assert _client(host.address).add("job/commit/e0/1/votes", 0) == SHARDS
    for address in host.shards:
        assert _client(address).add("job/commit/e0/1/votes", 0) == RANKS // SHARDS
        assert _client(address).get("job/commit/e0/1/decision") == b"commit"
    # Many steps: the job's store and each shard keep only the last step's keys.
    for step in range(2, 30):
        assert vote_all(ranks, step) == ["commit"] * RANKS
    assert _client(host.address).num_keys() <= 2 + 2 + SHARDS
    assert all(_client(a).num_keys() <= 1 + 3 for a in host.shards)
    for r in ranks:
        r.close()


def test_a_step_waits_for_every_shard_and_an_abort_reaches_them_all(
    host: RendezvousHost,
) -> None:
    ranks = _ranks(host.address)
    assert vote_all(ranks, 1) == ["commit"] * RANKS
    # Rank 4 (shard 1) is blocked in a collective: shard 1 never fills, so shard 0's
    # full vote alone cannot commit the step.
    for r in ranks:
        r.begin(2)
    voters = [r for i, r in enumerate(ranks) if i != 4]
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.extend(vote_all(voters, 2)))
    thread.start()
    thread.join(1.5)
    assert thread.is_alive() and not any(r.signal.is_set() for r in ranks)
    assert _client(host.address).add("job/commit/e0/2/votes", 0) == 1
    # A rank of shard 0 sees a collective fail: the blocked rank of the other shard,
    # which watches its shard, hears the abort through that shard's relay.
    ranks[1].abort("peer died")
    assert ranks[4].signal.wait(30)
    thread.join(60)
    assert outcome == ["abort"] * (RANKS - 1)
    assert all(r.committed == 1 for r in ranks)
    for r in ranks:
        r.close()


def test_a_shard_whose_relay_is_gone_reads_the_decision_from_the_job_store(
    host: RendezvousHost,
) -> None:
    ranks = _ranks(host.address)
    assert vote_all(ranks, 1) == ["commit"] * RANKS
    # Shard 1's relay (rank 3) stops, as with its machine; rank 0 (shard 0) aborts.
    ranks[3].close()
    for r in ranks:
        r.begin(2)
    ranks[0].abort("peer died")
    # Shard 1's other ranks are not told through their shard (nobody relays there), and
    # read the job's store when their watch slice ends.
    assert ranks[4].signal.wait(30) and ranks[5].signal.wait(30)
    assert _client(host.shards[1]).check(["job/commit/e0/2/decision"]) is False
    assert vote_all([ranks[4], ranks[5]], 2) == ["abort", "abort"]


def test_a_shard_filled_again_is_not_counted_twice_in_the_job_store(
    host: RendezvousHost,
) -> None:
    root = Store(host.address, 30)
    # Shard 0 of two voters fills; its second voter casts the shard's vote in the job's
    # store. Threshold there: 2 shards.
    first, second = (ShardVote(host.shards, v, 4, 30, relays=False) for v in (0, 1))
    assert not first.cast(root, "job/commit/e0/1", "job/commit/e0/0", "commit")
    assert not second.cast(root, "job/commit/e0/1", "job/commit/e0/0", "commit")
    assert root.count("job/commit/e0/1/votes") == 1
    # After the shard's loss its voters re-cast and another may find it full again
    # (here: the shard's counter brought back below its threshold by hand): its vote
    # must not count again, or shard 1's would never be needed.
    _client(host.shards[0]).add("job/commit/e0/1/votes", -1)
    again = ShardVote(host.shards, 0, 4, 30, relays=False)
    assert not again.cast(root, "job/commit/e0/1", "job/commit/e0/0", "commit")
    assert root.count("job/commit/e0/1/votes") == 1
    assert not root.check(["job/commit/e0/1/decision"])


def test_the_vote_goes_on_through_the_loss_of_the_serving_replica_and_its_shards() -> None:
    bases = [free_port_block(1 + SHARDS) for _ in range(2)]
    address = ",".join(f"127.0.0.1:{p}" for p in bases)

    def replica(i: int) -> RendezvousHost:
        peers = [f"127.0.0.1:{p}" for j, p in enumerate(bases) if j != i]
        return RendezvousHost(port=bases[i], peers=peers, index=i, shards=SHARDS)

    hosts = [replica(0), replica(1)]
    assert hosts[0].promoted.wait(10)
    # Every replica names the same shards: each one's replicas, in the job's order.
    assert (
        hosts[0].shards
        == hosts[1].shards
        == [f"127.0.0.1:{bases[0] + 1 + s},127.0.0.1:{bases[1] + 1 + s}" for s in range(SHARDS)]
    )
    ranks = _ranks(address, 4)
    for step in (1, 2):
        assert vote_all(ranks, step) == ["commit"] * 4
    # Step 3: three ranks voted (shard 0 full, its vote in the job's store) when the
    # serving replica goes with its shards; the last vote reaches the standby, and the
    # step commits once every rank has re-cast its share there.
    for r in ranks:
        r.begin(3)
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.extend(vote_all(ranks[:3], 3)))
    thread.start()
    thread.join(1.0)
    assert thread.is_alive()
    hosts.pop(0).close()
    assert vote_all(ranks[3:], 3) == ["commit"]
    thread.join(60)
    assert outcome == ["commit"] * 3
    assert hosts[0].promoted.is_set()
    assert Store(address, 30, share=Share(address)).count("job/commit/e0/3/votes") == SHARDS
    assert vote_all(ranks, 4) == ["commit"] * 4
    for r in ranks:
        r.close()
    hosts[0].close()
