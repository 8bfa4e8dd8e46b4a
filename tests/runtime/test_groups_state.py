"""Groups, the group table and state transfer, in one process (threads play the ranks)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.distributed import TCPStore

from trainmover.runtime.build import BuildAbandoned, GroupBuilder, build_group
from trainmover.runtime.data import TokenStream
from trainmover.runtime.groups import GroupTable, StaleMemberError
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.tcpstore import serve

CPU = torch.device("cpu")
A, B, C = (RankRef(machine=m, local_rank=0) for m in ("a", "b", "c"))


@pytest.fixture
def store():
    return serve("127.0.0.1")


def spec(name, generation, *members, kind="pp"):
    return GroupSpec(name=name, kind=kind, generation=generation, members=list(members))


def client(store):
    """A store client of its own: two ranks blocking on one shared client deadlock."""
    return TCPStore("127.0.0.1", store.port, is_master=False)


def build_pair(store, s, timeout_s=10, connections=1):
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(build_group, s, m, client(store), "j", CPU, timeout_s, None, connections)
            for m in s.members
        ]
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
    builder = GroupBuilder([s], A, lambda: client(store), "j", CPU, 10).start()
    assert not builder.done  # waits for B, while this thread keeps working
    other = build_group(s, B, client(store), "j", CPU, 10)
    (mine,) = builder.wait(10)
    t = torch.ones(2)
    threading.Thread(target=other.allreduce, args=(torch.ones(2),)).start()
    mine.allreduce(t)
    assert t.tolist() == [2.0, 2.0]


def test_the_builder_connects_to_the_store_on_its_own_thread(store):
    """A store failing over holds whoever connects until a replica serves: the caller
    starting a build (holding the rank's lock) never waits for it."""
    serving, connected_on = threading.Event(), []

    def connect():
        connected_on.append(threading.get_ident())
        serving.wait(30)
        return client(store)

    builder = GroupBuilder([spec("tp.c", 0, A, kind="tp")], A, connect, "j", CPU, 10).start()
    assert not builder.done  # still connecting, and this thread goes on
    serving.set()
    (group,) = builder.wait(10)
    assert connected_on and connected_on[0] != threading.get_ident()
    assert group.spec.name == "tp.c"
    group.shutdown()


def test_an_abandoned_build_stops_the_wait_and_shuts_its_groups_down(store):
    """A member that never comes (a failed machine): the caller gives up once told to,
    long before the group timeout, and what the builder still finishes is shut down."""
    alone = spec("tp.z", 0, A, kind="tp")
    never = spec("pp.z", 0, A, C)
    builder = GroupBuilder([alone, never], A, lambda: client(store), "j", CPU, 5).start()
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


def transfer_pair(store, timeout_s=10, connections=1):
    """A leaver's and a joiner's ends of a transfer pair (`timeout_s`: how long a side
    waits for a peer that stopped sending)."""
    pair = spec("transfer.p2.r0", 0, A, B, kind="transfer")
    return build_pair(store, pair, timeout_s, connections)


def send_in_thread(state, group, **kwargs):
    errors = []

    def run():
        try:
            state.send(group, 1, **kwargs)
        except Exception as exc:  # the test inspects what the sender hit
            errors.append(exc)

    thread = threading.Thread(target=run, name="sender", daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.parametrize(
    ("joiner_trained", "checksums", "connections", "chunk_bytes"),
    [(False, True, 1, 13), (True, True, 2, 13), (True, False, 3, 13), (True, True, 2, 4096)],
)
def test_a_streamed_transfer_lands_in_the_joiners_own_tensors(
    store, joiner_trained, checksums, connections, chunk_bytes
):
    """Chunks far smaller than a tensor (and not a multiple of a word), over one or more
    connections: each tensor arrives in pieces, in order, straight into the joiner's own
    parameter and optimizer storage when it has them, and training continues
    bit-identically. With chunks larger than the tensors, the small tensors travel packed
    together: fewer sends than tensors."""
    leaver, joiner, reference = make_state(1), make_state(2), make_state(1)
    train(leaver, 3)
    train(reference, 3)
    if joiner_trained:
        train(joiner, 1)  # a standby's shadow iterations gave it optimizer state
    storage = {
        n: t.data_ptr() for n, t in joiner.named_tensors().items() if not n.startswith("rng.")
    }
    left, joined = transfer_pair(store, connections=connections)
    sender, errors = send_in_thread(leaver, left, chunk_bytes=chunk_bytes, checksums=checksums)
    stats = joiner.receive(joined, 0)
    sender.join(30)
    assert not errors
    sent = leaver.named_tensors()
    assert stats.bytes == sum(t.numel() * t.element_size() for t in sent.values())
    if chunk_bytes == 13:
        assert stats.chunks > len(sent)
    else:
        assert stats.chunks < len(sent) / 2
    after = joiner.named_tensors()
    assert all(after[n].data_ptr() == p for n, p in storage.items())
    train(joiner, 2)
    train(reference, 2)
    ours, theirs = joiner.named_tensors(), reference.named_tensors()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def untouched(state):
    """What a transfer must not change unless it completes: step, optimizer, RNGs."""
    return (state.step, len(state.optimizer.state), state.generators["dropout"].get_state())


def test_a_transfer_cut_midway_leaves_the_joiner_unapplied(store, monkeypatch):
    """The sender dies after a few chunks: the joiner's receive fails, and its step,
    optimizer and RNGs are as before (it never trains on half a state)."""
    from trainmover.runtime import transfer

    leaver, joiner = make_state(1), make_state(2)
    train(leaver, 3)
    before = untouched(joiner)
    real = transfer._checksum
    left, joined = transfer_pair(store, timeout_s=2)

    def dies_after_three(chunk, index):
        if threading.current_thread().name == "sender" and index == 3:
            left.shutdown()  # its connection closes as a killed process's would
            raise RuntimeError("sender killed")
        return real(chunk, index)

    monkeypatch.setattr(transfer, "_checksum", dies_after_three)
    sender, _ = send_in_thread(leaver, left, chunk_bytes=16)
    with pytest.raises(RuntimeError):
        joiner.receive(joined, 0)
    sender.join(30)
    step, optim, rng = untouched(joiner)
    assert (step, optim) == before[:2] and torch.equal(rng, before[2])


def test_a_corrupted_chunk_fails_the_transfer_unapplied(store, monkeypatch):
    from trainmover.runtime import transfer

    leaver, joiner = make_state(1), make_state(2)
    train(leaver, 3)
    before = untouched(joiner)
    real = transfer._checksum

    def wrong_for_chunk_two(chunk, index):
        value = real(chunk, index)
        return value + 1 if threading.current_thread().name == "sender" and index == 2 else value

    monkeypatch.setattr(transfer, "_checksum", wrong_for_chunk_two)
    left, joined = transfer_pair(store)
    sender, errors = send_in_thread(leaver, left, chunk_bytes=16)
    with pytest.raises(transfer.TransferError, match="first: 2"):
        joiner.receive(joined, 0)
    sender.join(30)
    step, optim, rng = untouched(joiner)
    assert (step, optim) == before[:2] and torch.equal(rng, before[2])


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (lambda: torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)), r"\[5, 4\]"),
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double(),
            r"\[3, 4\] torch.float64, the sender sent \[3, 4\] torch.float32",
        ),
    ],
    ids=["shape", "dtype"],
)
def test_a_joiner_of_another_role_refuses_before_any_tensor_byte(store, other, named):
    from trainmover.runtime.state import TrainingState

    leaver = make_state(1)
    other = other()
    joiner = TrainingState(other, torch.optim.Adam(other.parameters()))
    weight = other[0].weight.detach().clone()
    left, joined = transfer_pair(store, timeout_s=2)
    sender, _ = send_in_thread(leaver, left)
    with pytest.raises(ValueError, match=f"model.0.weight: the joiner built {named}"):
        joiner.receive(joined, 0)
    joined.shutdown()
    sender.join(30)
    assert torch.equal(other[0].weight, weight)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4099])
@pytest.mark.parametrize("offset", [0, 3])
def test_the_chunk_checksum_is_the_wrapping_sum_of_the_bytes_words(size, offset):
    """The same value whatever the chunk's alignment, and the documented formula: both
    ends must agree byte for byte, whatever computes it."""
    import struct

    from trainmover.runtime import transfer

    data = bytes((i * 37 + 11) % 256 for i in range(size + offset))[offset:]
    chunk = torch.tensor(list(b"\0" * offset + data), dtype=torch.uint8)[offset:]
    words = size // 8
    total = sum(struct.unpack(f"<{words}Q", data[: words * 8])) + sum(data[words * 8 :])
    expected = (total + transfer._MIX * 4 + size) & transfer._MASK
    assert transfer._checksum(chunk, 3) == expected
    flipped = bytearray(data)
    if size:
        flipped[size // 2] ^= 1
        other = torch.tensor(list(flipped), dtype=torch.uint8)
        assert transfer._checksum(other, 3) != expected
