"""A job's cluster state in its bucket: stored as pieces under a head, read whole.

The pieces (`trainmover.statepieces`) are stored in chunks at keys
`cluster.<piece>.<chunk>`; the head, key `cluster` (STATE_KEY), is a
`cluster_state_head` naming the bucket revision of every chunk. A writer puts the
chunks of the pieces that changed, then the head, compare-and-set on the head's
revision (one planner per job). A reader reads the head, then exactly the revisions it
names (direct gets by sequence), so it sees one state whole, never pieces of two,
whatever is written meanwhile; it fetches and decodes only the pieces whose revisions
changed since its last read. A revision the bucket no longer holds (it keeps 16 per
key) means a newer head exists: the reader reads the head again (`StaleHead`).

A head that is a whole `cluster_state` (what older planners stored, and tests put) is
read as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats import errors as nats_errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from trainmover.bus.follow import CHECK_S, follow
from trainmover.logs import get_logger
from trainmover.messages import ClusterState, ClusterStateHead, MessageError, decode
from trainmover.statepieces import (
    HANDLED,
    REST,
    chunks,
    decode_piece,
    handled_piece,
    join,
    machine_piece,
    rest_piece,
    shard_count,
    shard_name,
    shards_of,
)
from trainmover.subjects import STATE_KEY

log = get_logger("bus")

#: How often a reader reads the head again when its pieces moved on meanwhile.
STALE_RETRIES = 8
_HEAD_MARK = b'"kind":"cluster_state_head"'


class StaleHead(Exception):
    """A head names a piece revision the bucket no longer holds: a newer head exists."""


@dataclass(frozen=True)
class Stored:
    """The state as read: `revision` is the head's bucket revision (what a writer's
    compare-and-set names), `bytes` the stored size of all its pieces."""

    state: ClusterState
    revision: int
    bytes: int


@dataclass(frozen=True)
class _Piece:
    revisions: tuple[int, ...]
    state: ClusterState
    size: int


def piece_key(piece: str, chunk: int) -> str:
    return f"{STATE_KEY}.{piece}.{chunk}"


def is_head(value: bytes) -> bool:
    # The planner's heads begin with their version and kind (pydantic's field order).
    return _HEAD_MARK in value[:80]


class StateStore:
    """One process's reads (and, for the planner, writes) of a job's stored state; it
    remembers the pieces it last read or wrote, so that the next read or write moves only
    what changed."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self._pieces: dict[str, _Piece] = {}

    # --- reading -----------------------------------------------------------------------

    async def read(self) -> Stored | None:
        """The newest state; None when none is stored (no planner has run yet)."""
        for _ in range(STALE_RETRIES):
            try:
                entry = await self._kv.get(STATE_KEY)
            except KeyNotFoundError:
                return None
            if not entry.value:
                return None
            try:
                return await self.resolve(entry.value, int(entry.revision or 0))
            except StaleHead:
                continue
        raise StaleHead(f"{STATE_KEY}: the pieces moved on {STALE_RETRIES} times over")

    async def resolve(self, value: bytes, revision: int) -> Stored:
        """The state a head value (from a get or a watch) names; StaleHead when its
        pieces are gone, MessageError when it is not valid."""
        if not is_head(value):
            return Stored(decode(ClusterState, value), revision, len(value))
        head = decode(ClusterStateHead, value)
        cached = self._pieces  # as it is now: another read may replace it meanwhile
        wanted = {
            name: tuple(revs)
            for name, revs in head.pieces.items()
            if name not in cached or cached[name].revisions != tuple(revs)
        }
        fetched = await asyncio.gather(*(self._fetch(n, r) for n, r in wanted.items()))
        mine = {n: cached[n] for n in head.pieces if n not in wanted}
        mine |= dict(zip(wanted, fetched, strict=True))
        state = join(head, {n: p.state for n, p in mine.items()})
        self._pieces = mine
        return Stored(state, revision, head.bytes + len(value))

    async def _fetch(self, name: str, revisions: tuple[int, ...]) -> _Piece:
        async def get(chunk: int, revision: int) -> bytes:
            try:
                entry = await self._kv.get(piece_key(name, chunk), revision=revision)
            except KeyNotFoundError:
                raise StaleHead(f"{piece_key(name, chunk)} revision {revision}") from None
            return entry.value or b""

        raw = b"".join(await asyncio.gather(*(get(j, r) for j, r in enumerate(revisions))))
        return _Piece(revisions, decode_piece(raw), len(raw))

    async def follow(self, check_s: float = CHECK_S) -> AsyncIterator[Stored]:
        """Every state from now on (first the current one), in order, as `bus.follow`
        follows the head. A head whose pieces moved on is skipped for the newest one; one
        that is not valid is logged and skipped (the next may be); a read the bus does
        not answer (a server lost, a leader being elected) is tried again.

        A head older than the state last yielded is passed over: a follower that fell
        more than the bucket's history behind a burst of writes (a large job starting: a
        revision a machine) finds its head's pieces gone and jumps to the newest state;
        the heads queued behind the one it jumped from are older, and reading each one's
        pieces would keep it behind for good."""
        last = 0
        async for value in follow(self._kv, STATE_KEY, check_s=check_s):
            if value.revision <= last:
                continue
            stored = await self._resolve_or_newest(value.value, value.revision)
            if stored is not None:
                last = stored.revision
                yield stored

    async def _resolve_or_newest(self, value: bytes, revision: int) -> Stored | None:
        delay = 0.05
        while True:
            try:
                try:
                    return await self.resolve(value, revision)
                except StaleHead:
                    newest = await self.read()
                return newest if newest is not None and newest.revision >= revision else None
            except MessageError as err:
                log.error("bad_cluster_state", revision=revision, error=str(err))
                return None
            except (StaleHead, nats_errors.Error, TimeoutError) as err:
                log.warning("cluster_state_read_retry", revision=revision, error=repr(err))
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)

    # --- writing (the planner) -----------------------------------------------------------

    async def write(self, state: ClusterState, last: int | None) -> int:
        """Stores `state`: the pieces that changed, then the head, created (`last` None)
        or updated if its revision is still `last`; returns the head's new revision.
        Raises what the head's create or update raises (KeyWrongLastSequenceError: someone
        else wrote; not when the head found is this very one, stored by an earlier try),
        and then forgets what it knew of the stored pieces."""
        shards = shard_count(len(state.machines))
        resharded = shards != sum(1 for n in self._pieces if n not in (REST, HANDLED))
        pieces = {REST: rest_piece(state)}
        if HANDLED not in self._pieces or self._pieces[HANDLED].state.handled != state.handled:
            pieces[HANDLED] = handled_piece(state)
        for i, machines in enumerate(shards_of(state.machines, shards)):
            name = shard_name(i)
            known = self._pieces.get(name)
            # Dict equality tries identity first: the unchanged machines of a decision
            # are the same objects, so this costs little more than a pass over the names.
            if resharded or known is None or known.state.machines != machines:
                pieces[name] = machine_piece(state, machines)
        raws = {name: piece.to_json() for name, piece in pieces.items()}
        written = await asyncio.gather(*(self._put(n, raw) for n, raw in raws.items()))
        stored = {**self._pieces}
        for (name, raw), revs in zip(raws.items(), written, strict=True):
            stored[name] = _Piece(revs, pieces[name], len(raw))
        names = [REST, HANDLED, *(shard_name(i) for i in range(shards))]
        head = ClusterStateHead(
            job=state.job,
            revision=state.revision,
            shards=shards,
            pieces={n: list(stored[n].revisions) for n in names},
            bytes=sum(stored[n].size for n in names),
        )
        value = head.to_json()
        try:
            try:
                if last is None:
                    revision = await self._kv.create(STATE_KEY, value)
                else:
                    revision = await self._kv.update(STATE_KEY, value, last=last)
            except KeyWrongLastSequenceError:
                landed = await self._landed(value)
                if landed is None:
                    raise
                revision = landed
        except Exception:
            self._pieces.clear()
            raise
        self._pieces = {n: stored[n] for n in names}
        return int(revision)

    async def _landed(self, value: bytes) -> int | None:
        """The head's revision if it is `value`, this writer's own head: its pieces'
        revisions were made by this writer's puts alone, so an equal head is the one an
        earlier try of the same update stored (the request sent again after its answer
        was lost), not another writer's."""
        try:
            entry = await self._kv.get(STATE_KEY)
        except KeyNotFoundError:
            return None
        return int(entry.revision or 0) if entry.value == value else None

    async def _put(self, name: str, raw: bytes) -> tuple[int, ...]:
        parts = chunks(raw)
        revs = await asyncio.gather(
            *(self._kv.put(piece_key(name, j), part) for j, part in enumerate(parts))
        )
        return tuple(int(r) for r in revs)


async def read_state(kv: KeyValue) -> ClusterState | None:
    """The job's newest state, read once; None when none is stored."""
    stored = await StateStore(kv).read()
    return None if stored is None else stored.state


async def follow_states(kv: KeyValue, check_s: float = CHECK_S) -> AsyncIterator[ClusterState]:
    """`StateStore.follow`, the states alone."""
    async for stored in StateStore(kv).follow(check_s):
        yield stored.state
