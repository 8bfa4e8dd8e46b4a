"""In-process unit tests: the commit agreement over a real store, the sandbox's local
answers and record store, checkpoints, and the unplanned plan's state sources."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.runtime.votes import vote_all
from trainmover.runtime import checkpoint
from trainmover.runtime.abort import AbortSignal
from trainmover.runtime.agreement import CommitAgreement
from trainmover.runtime.layout import Layout, MachineRole, Role
from trainmover.runtime.plan import compute_delta
from trainmover.runtime.sandbox import (
    DirectoryRecordStore,
    Recorder,
    SandboxGroup,
    SandboxStats,
    load_record,
    sandbox_specs,
)
from trainmover.runtime.state import TrainingState
from trainmover.runtime.storeclient import Store
from trainmover.runtime.tcpstore import serve


@pytest.fixture
def store_address():
    store = serve("127.0.0.1")
    yield f"127.0.0.1:{store.port}"
    del store


def _ranks(address: str, world: int) -> list[CommitAgreement]:
    return [
        CommitAgreement(address, "job", world, AbortSignal("e0"), committed=0, timeout_s=30)
        for _ in range(world)
    ]


def test_a_step_commits_only_when_every_rank_voted(store_address: str) -> None:
    ranks = _ranks(store_address, 3)
    assert vote_all(ranks, 1) == ["commit"] * 3
    assert [r.committed for r in ranks] == [1, 1, 1]
    # A rank that never votes (blocked, or dead) holds the step until someone aborts:
    # then nobody applies it, and every rank's signal is set by the store's decision.
    ranks[2].begin(2)
    ranks[2].abort("peer died")
    assert vote_all(ranks[:2], 2) == ["abort", "abort"]
    assert all(r.signal.is_set() for r in ranks) and ranks[0].committed == 1
    for r in ranks:
        r.close()


def test_an_abort_after_the_commit_stops_the_next_step(store_address: str) -> None:
    ranks = _ranks(store_address, 2)
    vote_all(ranks, 1)
    ranks[0].committed = 0  # a rank that has not read step 1's verdict yet aborts
    ranks[0].abort("late")
    ranks[0].committed = 1
    # Step 1 stays committed; step 2 can never commit in this epoch.
    assert vote_all(ranks, 2) == ["abort", "abort"]
    for r in ranks:
        r.close()


def test_a_stale_epoch_abort_is_ignored(store_address: str) -> None:
    (rank,) = _ranks(store_address, 1)
    rank.signal.reset("r1")
    rank.reset("r1", committed=5)
    assert not rank.abort("old news", epoch="e0")
    assert not rank.signal.is_set()
    assert vote_all([rank], 6) == ["commit"]
    rank.close()


def test_sandbox_replays_recordings_and_synthesises_valid_values(tmp_path: Path) -> None:
    store = DirectoryRecordStore(tmp_path / "records")
    recorder = Recorder()
    recorder.tap(3, torch.full((2, 4), 0.5))
    size = recorder.save(store, "last")
    assert size > 0 and store.size_bytes() >= size
    specs = sandbox_specs("s0", Layout(tp=2, pp=2, dp=2), "round1")
    stats = SandboxStats()
    pp = SandboxGroup(specs["pp"], 1, load_record(store, "last"), stats, seed=7)
    replayed, synthesised = torch.empty(2, 4), torch.empty(3, 4)
    pp.recv(replayed, 0, tag=3)
    pp.recv(synthesised, 0, tag=4)
    assert torch.equal(replayed, torch.full((2, 4), 0.5))
    assert torch.isfinite(synthesised).all() and synthesised.abs().sum() > 0
    dp = SandboxGroup(specs["dp"], 0, {}, stats, seed=7)
    grad = torch.ones(3)
    dp.allreduce(grad)
    assert torch.equal(grad / dp.size, torch.ones(3))  # the average is our own gradient
    assert (stats.replayed, stats.synthesized) == (1, 2)
    assert load_record(store, "first") == {}


def test_unplanned_plan_takes_state_from_the_replica() -> None:
    layout = Layout(tp=2, pp=2, dp=2)
    assignment = {f"m{i}": cell for i, cell in enumerate(layout.cells())}
    generations = dict.fromkeys(layout.all_groups(), 0)
    plan = compute_delta(
        job="j",
        plan_id="r1",
        layout=layout,
        assignment=assignment,
        generations=generations,
        moves={"m0": "s0"},
        sources={"m0": "m2"},  # m2 serves (dp 1, pp 0): m0's replica
    )
    assert [[str(r) for r in t.members] for t in plan.transfers] == [
        ["m2/0", "s0/0"],
        ["m2/1", "s0/1"],
    ]
    assert plan.sources() == {"m2"}
    with pytest.raises(ValueError, match="replica"):
        compute_delta(
            job="j",
            plan_id="r2",
            layout=layout,
            assignment=assignment,
            generations=generations,
            moves={"m0": "s0"},
            sources={"m0": "m1"},  # another stage: not a replica
        )
    fallback = compute_delta(
        job="j",
        plan_id="r3",
        layout=layout,
        assignment=assignment,
        generations=generations,
        moves={"m0": "s0"},
        restore="checkpoint",
    )
    assert fallback.transfers == [] and fallback.restore == "checkpoint"
    assert layout.role_types() == ["first", "last"]
    assert layout.role_of_type("last", 1) == Role(dp=0, pp=1, tp=1)
    assert MachineRole(dp=0, pp=0) == plan.moves[0].cell


def test_checkpoints_are_atomic_pruned_and_agreed(tmp_path: Path, store_address: str) -> None:
    model = torch.nn.Linear(2, 2)
    state = TrainingState(model, torch.optim.Adam(model.parameters()))
    roles = [Role(dp=0, pp=p, tp=0) for p in range(2)]
    for step in (4, 8, 12):
        state.step = step
        checkpoint.write(tmp_path, roles[0], state)
    state.step = 8
    checkpoint.write(tmp_path, roles[1], state)
    assert checkpoint.steps_of(tmp_path, roles[0]) == [8, 12]  # the last KEEP
    host, _, port = store_address.rpartition(":")
    agreed: dict[int, int] = {}

    def agree(i: int) -> None:  # each rank on its own store connection, concurrently
        store = Store(store_address, 30)
        agreed[i] = checkpoint.agree_step(store, "p/", roles[i], roles, tmp_path, 30)

    threads = [threading.Thread(target=agree, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert agreed == {0: 8, 1: 8}
    checkpoint.load(tmp_path, roles[0], 8, state)
    assert state.step == 8


def test_a_checkpoint_restore_with_a_role_never_saved_stops_every_rank_alike(
    tmp_path: Path, store_address: str
) -> None:
    model = torch.nn.Linear(2, 2)
    state = TrainingState(model, torch.optim.Adam(model.parameters()))
    roles = [Role(dp=0, pp=p, tp=0) for p in range(2)]
    state.step = 40
    checkpoint.write(tmp_path, roles[0], state)  # roles[1] (the dead one's) has none
    errors: dict[int, str] = {}

    def agree(i: int) -> None:
        try:
            checkpoint.agree_step(Store(store_address, 30), "q/", roles[i], roles, tmp_path, 30)
        except checkpoint.NoCheckpoint as err:
            errors[i] = str(err)

    threads = [threading.Thread(target=agree, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors[0] == errors[1]
    assert f"no checkpoint of {roles[1].key} in {tmp_path}" in errors[0]
    assert "runtime.checkpoint_every is 0" in errors[0] and "step 0" in errors[0]
