"""Groups, the group table and state transfer, in one process (threads play the ranks)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.distributed import TCPStore

from trainmover.runtime.data import TokenStream
from trainmover.runtime.groups import (
    BuildAbandoned,
    GroupBuilder,
    GroupTable,
    StaleMemberError,
    build_group,
)
from trainmover.runtime.plan import GroupSpec, RankRef

CPU = torch.device("cpu")
A, B, C = (RankRef(machine=m, local_rank=0) for m in ("a", "b", "c"))


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def spec(name, generation, *members, kind="pp"):
    return GroupSpec(name=name, kind=kind, generation=generation, members=list(members))


def client(store):
    """A store client of its own: two ranks blocking on one shared client deadlock."""
    return TCPStore("127.0.0.1", store.port, is_master=False)


def build_pair(store, s):
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(build_group, s, m, client(store), "j", CPU, 10) for m in s.members]
        return [f.result() for f in futures]


def test_a_group_slot_belongs_to_its_first_claimant(store):
    s = spec("pp.x", 0, A)
    group = build_group(s, A, store, "j", CPU, 10)
    impostor = spec("pp.x", 0, C)  # same name and generation, another member list
    with pytest.raises(StaleMemberError):
        build_group(impostor, C, store, "j", CPU, 10)
    group.shutdown()


def test_table_swap_replaces_only_the_named_kinds(store):
    table = GroupTable()
    old = build_pair(store, spec("pp.x", 0, A, B))[0]
    tp = build_group(spec("tp.x", 0, A, kind="tp"), A, store, "j", CPU, 10)
    table.install([old, tp])
    new = build_pair(store, spec("pp.x", 1, A, C))[0]
    assert table.install([new]) == [old]
    assert table["pp"] is new and table["tp"] is tp
    with pytest.raises(StaleMemberError):  # never back to an older generation
        table.install([old])
    snap = table.snapshot()
    assert snap["pp"]["generation"] == 1 and snap["tp"]["incarnation"] == tp.incarnation


def test_background_builder_overlaps_with_other_work(store):
    s = spec("dp.y", 0, A, B, kind="dp")
    builder = GroupBuilder([s], A, client(store), "j", CPU, 10).start()
    assert not builder.done  # waits for B, while this thread keeps working
    other = build_group(s, B, client(store), "j", CPU, 10)
    (mine,) = builder.wait(10)
    t = torch.ones(2)
    threading.Thread(target=other.allreduce, args=(torch.ones(2),)).start()
    mine.allreduce(t)
    assert t.tolist() == [2.0, 2.0]


def test_an_abandoned_build_stops_the_wait_and_shuts_its_groups_down(store):
    """A member that never comes (a failed machine): the caller gives up once told to,
    long before the group timeout, and what the builder still finishes is shut down."""
    alone = spec("tp.z", 0, A, kind="tp")
    never = spec("pp.z", 0, A, C)
    builder = GroupBuilder([alone, never], A, client(store), "j", CPU, 5).start()
    superseded = threading.Event()
    threading.Timer(0.3, superseded.set).start()
    with pytest.raises(BuildAbandoned):
        builder.wait(60, abandon=superseded.is_set)
    assert not builder.done  # still waiting for C in the background
    assert builder._done.wait(30)  # the rendezvous times out on its own
    assert builder.built == []  # the one-member group it built was shut down


def make_state(init_seed, seed=7):
    """A role built from the job config (`seed`: data stream) with its own init."""
    from trainmover.runtime.state import TrainingState

    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    data = TokenStream(seed, 8, 16, 2, 0, 1)
    gen = torch.Generator().manual_seed(init_seed)
    return TrainingState(model, opt, {"data": data}, {"dropout": gen})


def train(state, steps):
    for _ in range(steps):
        state.optimizer.zero_grad()
        x, _ = state.stateful["data"].next_batch()
        noise = torch.rand(1, generator=state.generators["dropout"])
        state.model(x[:, :4].float() * noise).sum().backward()
        state.optimizer.step()
        state.step += 1


def test_joiner_continues_bit_identically_after_transfer(store):
    leaver, joiner, reference = make_state(1), make_state(2), make_state(1)
    train(leaver, 3)
    train(reference, 3)
    left, joined = build_pair(store, spec("transfer.p1.r0", 0, A, B, kind="transfer"))
    sender = threading.Thread(target=leaver.send, args=(left, 1))
    sender.start()
    stats = joiner.receive(joined, 0)
    sender.join()
    assert stats.bytes > 0 and joiner.step == 3
    assert joiner.stateful["data"].position == 3
    train(joiner, 2)
    train(reference, 2)
    ours, theirs = joiner.named_tensors(), reference.named_tensors()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
