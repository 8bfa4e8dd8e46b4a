"""The cluster state stored as pieces under a head (`trainmover.statepieces`,
`trainmover.bus.clusterstate`): a state too large for one message is stored and read
whole, an update moves only what changed, and a reader never mixes two states."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NatsClient
from nats.errors import MaxPayloadError
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tests.conftest import sample_state
from trainmover import bus, statepieces
from trainmover.bus.clusterstate import StaleHead, StateStore, follow_states, piece_key
from trainmover.messages import MAX_MESSAGE_BYTES, ClusterState, ClusterStateHead, MachineState
from trainmover.runtime.layout import Layout
from trainmover.statepieces import CHUNK_BYTES, HANDLED, REST
from trainmover.subjects import STATE_KEY

#: The smallest job (machines of 8 GPUs, PP8, standbys 1 %, a multiple of 64) whose
#: state, with its memory of handled events full, no longer fits one message.
TOO_LARGE = 5120


def large_state(machines: int, job: str = "big") -> ClusterState:
    """As the planner holds it once every machine is admitted and events were handled."""
    layout = Layout(tp=8, pp=8, dp=machines // 8)
    state = {
        f"m{i}": MachineState(status="active", cell=cell, instance=f"{i:032x}")
        for i, cell in enumerate(layout.cells())
    }
    for s in range(machines // 100):
        state[f"s{s}"] = MachineState(
            status="standby", warm_role_types=["first", "middle", "last"], instance=f"{s:032x}"
        )
    handled = {f"hm-{i:040x}": f"{i:032x}" for i in range(4096)}
    return ClusterState(job=job, layout=layout, machines=state, handled=handled, revision=7)


def test_a_state_too_large_for_one_message_splits_into_values_that_fit() -> None:
    state = large_state(TOO_LARGE)
    assert len(state.to_json()) > MAX_MESSAGE_BYTES  # one value: over the bus's limit
    shards, pieces = statepieces.split(state)
    assert shards == 32  # 5,171 machines with the standbys
    values = [c for p in pieces.values() for c in statepieces.chunks(p.to_json())]
    assert max(len(v) for v in values) <= CHUNK_BYTES
    head = ClusterStateHead(
        job=state.job,
        revision=state.revision,
        shards=shards,
        pieces={n: [1] for n in pieces},
        bytes=0,
    )
    decoded = {n: statepieces.decode_piece(p.to_json()) for n, p in pieces.items()}
    assert statepieces.join(head, decoded) == state


def test_join_refuses_a_head_whose_pieces_are_not_all_there() -> None:
    state = sample_state("j")
    shards, pieces = statepieces.split(state)
    head = ClusterStateHead(
        job="j", revision=0, shards=shards, pieces={n: [1] for n in pieces}, bytes=0
    )
    del pieces[HANDLED]
    with pytest.raises(ValueError, match="missing"):
        statepieces.join(head, pieces)


def test_shards_grow_by_doubling_and_each_machine_has_one() -> None:
    assert [statepieces.shard_count(n) for n in (1, 256, 257, 2069, 8274)] == [1, 1, 2, 16, 64]
    names = [f"m{i}" for i in range(3000)]
    shards = statepieces.shard_count(len(names))
    assert sorted(n for s in statepieces.shards_of(dict.fromkeys(names), shards) for n in s) == (
        sorted(names)
    )


async def _head(nc: NatsClient, job: str) -> ClusterStateHead:
    kv = await bus.job_bucket(nc.jetstream(), job)
    return ClusterStateHead.model_validate_json((await kv.get(STATE_KEY)).value or b"")


async def test_a_state_over_the_payload_limit_is_stored_and_read_whole(
    nc: NatsClient, job: str
) -> None:
    kv = await bus.ensure_job(nc.jetstream(), job)
    state = large_state(TOO_LARGE, job)
    with pytest.raises(MaxPayloadError):  # what one value of it meets
        await kv.put(STATE_KEY, state.to_json())
    revision = await StateStore(kv).write(state, last=None)
    stored = await StateStore(kv).read()
    assert stored is not None and stored.revision == revision
    assert stored.state == state
    assert stored.bytes > MAX_MESSAGE_BYTES


async def test_an_update_rewrites_the_changed_shard_and_the_rest_only(
    nc: NatsClient, job: str
) -> None:
    kv = await bus.ensure_job(nc.jetstream(), job)
    writer = StateStore(kv)
    state = large_state(1024, job)
    revision = await writer.write(state, last=None)
    before = await _head(nc, job)
    machines = {**state.machines, "m5": state.machines["m5"].model_copy(update={"instance": "x"})}
    changed = state.model_copy(update={"machines": machines, "revision": 8})
    await writer.write(changed, last=revision)
    after = await _head(nc, job)
    moved = {n for n in after.pieces if after.pieces[n] != before.pieces[n]}
    assert moved == {REST, statepieces.shard_name(statepieces.shard_of("m5", after.shards))}
    reader = StateStore(kv)
    read = await reader.read()
    assert read is not None and read.state == changed


async def _stored_sample(
    nc: NatsClient, job: str
) -> tuple[KeyValue, StateStore, ClusterState, int]:
    kv = await bus.ensure_job(nc.jetstream(), job)
    writer = StateStore(kv)
    state = sample_state(job)
    return kv, writer, state, await writer.write(state, last=None)


async def _revisions(writer: StateStore, state: ClusterState, last: int, upto: int) -> int:
    """`state` at revisions 1..upto, each written; the head's last revision."""
    for revision in range(1, upto + 1):
        last = await writer.write(state.model_copy(update={"revision": revision}), last=last)
    return last


async def test_a_reader_of_a_head_whose_pieces_moved_on_reads_the_newest(
    nc: NatsClient, job: str
) -> None:
    """The bucket keeps 16 revisions a key: a head older than that names pieces gone."""
    kv, writer, state, last = await _stored_sample(nc, job)
    old = await kv.get(STATE_KEY)
    await _revisions(writer, state, last, 19)
    with pytest.raises(StaleHead):
        await StateStore(kv).resolve(old.value or b"", int(old.revision or 0))
    newest = await StateStore(kv).read()
    assert newest is not None and newest.state.revision == 19


async def test_a_follower_sees_every_state_in_order_and_reads_a_whole_one_too(
    nc: NatsClient, job: str
) -> None:
    kv, writer, state, last = await _stored_sample(nc, job)
    seen: list[int] = []
    started = asyncio.Event()

    async def follow() -> None:
        async for s in follow_states(kv):
            seen.append(s.revision)
            started.set()
            if s.revision == 100:  # the whole value put below
                return

    following = asyncio.create_task(follow())
    await asyncio.wait_for(started.wait(), 30)
    await _revisions(writer, state, last, 5)
    # A whole `cluster_state` at the head (an older planner's) is read as it is.
    await kv.put(STATE_KEY, state.model_copy(update={"revision": 100}).to_json())
    await asyncio.wait_for(following, 30)
    assert seen == [0, 1, 2, 3, 4, 5, 100]
    assert await kv.get(piece_key(REST, 0))  # the pieces stay where the head left them


async def test_a_follower_far_behind_jumps_to_the_newest_and_stays_there(
    nc: NatsClient, job: str
) -> None:
    """Behind by more than the bucket's history, the heads it has queued name pieces gone:
    it reads the newest state once and passes over the older heads, not once each."""
    kv, writer, state, last = await _stored_sample(nc, job)
    seen: list[int] = []
    first, release, caught_up = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def follow() -> None:
        async for s in follow_states(kv):
            seen.append(s.revision)
            first.set()
            if len(seen) == 1:
                await release.wait()  # held here while the writes below queue up
            if s.revision == 30:
                caught_up.set()
            if s.revision == 31:
                return

    following = asyncio.create_task(follow())
    await asyncio.wait_for(first.wait(), 30)
    last = await _revisions(writer, state, last, 30)
    release.set()
    await asyncio.wait_for(caught_up.wait(), 30)
    await writer.write(state.model_copy(update={"revision": 31}), last=last)
    await asyncio.wait_for(following, 30)
    assert seen == [0, 30, 31]


async def test_an_update_sent_again_after_it_landed_is_not_taken_for_another_writer(
    nc: NatsClient, job: str
) -> None:
    kv, writer, state, revision = await _stored_sample(nc, job)
    update = kv.update

    async def sent_twice(key: str, value: bytes, last: int | None = None) -> int:
        # What a client does when the first answer is lost: the same request again,
        # which the server, holding the first, refuses as a wrong last revision.
        await update(key, value, last=last)
        return await update(key, value, last=last)

    kv.update = sent_twice  # type: ignore[method-assign]
    newer = state.model_copy(update={"revision": state.revision + 1})
    landed = await writer.write(newer, last=revision)
    assert landed > revision
    read = await StateStore(kv).read()
    assert read is not None and read.state == newer and read.revision == landed
    # Another writer's head is still a conflict.
    other = StateStore(kv)
    await other.write(newer.model_copy(update={"revision": newer.revision + 1}), last=landed)
    kv.update = update  # type: ignore[method-assign]
    with pytest.raises(KeyWrongLastSequenceError):
        await writer.write(newer.model_copy(update={"revision": 99}), last=landed)
