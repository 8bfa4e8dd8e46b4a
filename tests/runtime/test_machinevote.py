"""The commit vote with one voter per machine (`machinevote`): two machines of two ranks,
each rank a thread with its own clients, a real TCPStore as the job's store, and each
machine's store hosted by its local rank 0."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tests.runtime.votes import vote_all
from trainmover.runtime.abort import AbortSignal, StepAborted
from trainmover.runtime.agreement import CommitAgreement
from trainmover.runtime.machinevote import MachineStore, MachineTally
from trainmover.runtime.tcpstore import serve

pytestmark = pytest.mark.timeout(120)

MACHINES, LOCAL = 2, 2


@pytest.fixture
def job_store() -> Iterator[tuple[str, dist.TCPStore]]:
    store = serve("127.0.0.1")
    yield f"127.0.0.1:{store.port}", store
    del store


def _job(address: str) -> tuple[list[MachineTally], list[CommitAgreement]]:
    """Ranks in machine order: machine m's local rank r is ranks[m * LOCAL + r]; each
    local rank 0 hosts its machine's store, which the others are given."""
    tallies = []
    for _ in range(MACHINES):
        server = MachineStore()
        tallies += [
            MachineTally(server.address, r, LOCAL, 30, server=server if r == 0 else None)
            for r in range(LOCAL)
        ]
    ranks = [
        CommitAgreement(
            address, "job", MACHINES * LOCAL, AbortSignal("e0"), 0, timeout_s=30, machine=tally
        )
        for tally in tallies
    ]
    return tallies, ranks


def test_the_job_store_counts_one_vote_per_machine(job_store) -> None:
    address, store = job_store
    tallies, ranks = _job(address)
    assert all(r.voters == MACHINES for r in ranks)
    machines = [t.server for t in tallies if t.server is not None]
    assert vote_all(ranks, 1) == ["commit"] * 4
    assert store.add("job/commit/e0/1/votes", 0) == MACHINES
    # Many steps: each machine's store keeps only the last steps' keys.
    for step in range(2, 21):
        assert vote_all(ranks, step) == ["commit"] * 4
    assert [r.committed for r in ranks] == [20] * 4
    assert store.add("job/commit/e0/20/votes", 0) == MACHINES
    for m in machines:
        client = dist.TCPStore("127.0.0.1", int(m.address.rsplit(":")[1]), is_master=False)
        assert client.num_keys() <= 4
    for r in ranks:
        r.close()


def test_a_step_waits_for_every_rank_of_a_machine_and_an_abort_reaches_them_all(
    job_store,
) -> None:
    address, _ = job_store
    _, ranks = _job(address)
    assert vote_all(ranks, 1) == ["commit"] * 4
    # Machine 0's local rank 1 is blocked in a collective: it never votes. Its machine
    # has not voted either, so the step waits (everyone else voted).
    for r in ranks:
        r.begin(2)
    voters = [ranks[0], *ranks[2:]]
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.extend(vote_all(voters, 2)))
    thread.start()
    thread.join(1.5)
    assert thread.is_alive() and not any(r.signal.is_set() for r in ranks)
    # A rank of the other machine sees a collective fail: the blocked rank, which only
    # watches its machine's store, hears the abort from its local rank 0's relay.
    ranks[3].abort("peer died")
    assert ranks[1].signal.wait(30)
    thread.join(60)
    assert outcome == ["abort"] * 3
    assert all(r.committed == 1 for r in ranks)
    for r in ranks:
        r.close()


def test_a_machine_store_gone_aborts_the_step(job_store) -> None:
    address, _ = job_store
    tallies, ranks = _job(address)
    assert vote_all(ranks, 1) == ["commit"] * 4
    tallies[0].server = None  # local rank 0's process died: the machine's store with it
    for r in ranks:
        r.begin(2)
    with pytest.raises(StepAborted):
        ranks[0].vote(2)
    assert "the machine's vote store is gone" in (ranks[0].signal.reason or "")
    # The abort is the job's decision: the other machine's ranks apply nothing either.
    assert vote_all(ranks[2:], 2) == ["abort", "abort"]
    for r in ranks:
        r.close()


def _decision_in_machine_store(tally: MachineTally, step: int) -> str | None:
    assert tally.server is not None
    host, _, port = tally.server.address.rpartition(":")
    client = dist.TCPStore(host, int(port), is_master=False)
    value = client.compare_set(f"job/commit/e0/{step}/machine/decision", "?", "?").decode()
    return None if value == "?" else value


def test_a_local_rank_0_vote_returns_only_once_its_machine_has_the_decision(job_store) -> None:
    address, _ = job_store
    tallies, ranks = _job(address)
    relay = tallies[0].relay

    def slow_relay(step_key: str, decision: str) -> None:
        time.sleep(0.3)  # a loaded host: the relay lags the watcher's read
        relay(step_key, decision)

    tallies[0].relay = slow_relay  # type: ignore[method-assign]
    seen: list[str | None] = []

    def vote_then_look() -> None:
        ranks[0].begin(1)
        ranks[0].vote(1)
        seen.append(_decision_in_machine_store(tallies[0], 1))

    thread = threading.Thread(target=vote_then_look)
    thread.start()
    assert vote_all(ranks[1:], 1) == ["commit"] * 3
    thread.join(60)
    assert seen == ["commit"]
    for r in ranks:
        r.close()


def test_a_rank_whose_local_rank_0_stopped_at_the_decision_still_learns_it(job_store) -> None:
    address, _ = job_store
    tallies, ranks = _job(address)
    assert vote_all(ranks, 1) == ["commit"] * 4

    def stop(step_key: str, decision: str) -> None:
        tallies[0].server = None  # local rank 0's process ended with its last step

    tallies[0].relay = stop  # type: ignore[method-assign]
    assert vote_all(ranks, 2) == ["commit"] * 4
    assert [r.committed for r in ranks] == [2] * 4
    for r in ranks:
        r.close()
