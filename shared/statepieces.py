"""The cluster state cut into the pieces it is stored as, and put back together, pure.

One JSON value of a job's whole cluster state grows by ~145 bytes a machine and its
memory of handled events by up to ~300 kB: at ~6,000 machines it passes JetStream's
payload limit (1 MiB), and long before that every update rewrote, and every follower
decoded, all of it (one update per machine admitted while a large job starts). So the
state is stored as pieces, each itself a partial `cluster_state` (job and layout, and
one part of the rest):

- `m<i>`: the machines of shard i of `shards` (machine m is in crc32(m) % shards, the
  number of shards a power of two of about MACHINES_PER_SHARD machines each);
- `handled`: the memory of handled events (it changes with events, not machines);
- `rest`: everything else (in-flight plans, queue, generations, outbox, revision).

An update changes a piece or two; a machine's heartbeat admitted rewrites its shard
alone. Each piece is stored in chunks of at most CHUNK_BYTES (`chunks`), so no value
nears the limit whatever the job's size. `trainmover.bus.clusterstate` keeps them in
the job's bucket with a head naming each chunk's revision.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from pydantic import ValidationError

from trainmover.messages import (
    MAX_MESSAGE_BYTES,
    ClusterState,
    ClusterStateHead,
    MachineState,
    MessageError,
    decode,
)

MACHINES_PER_SHARD = 256
"""About how many machines a shard holds (~37 kB of JSON)."""

CHUNK_BYTES = 256 * 1024
"""Largest stored value of a piece: a quarter of the bus's payload limit."""

REST, HANDLED = "rest", "handled"


def shard_count(machines: int) -> int:
    """Shards for a job of `machines`: a power of two, so that it changes (and every
    machine moves shard) only when the job doubles."""
    shards = 1
    while shards * MACHINES_PER_SHARD < machines:
        shards *= 2
    return shards


def shard_of(machine: str, shards: int) -> int:
    return zlib.crc32(machine.encode()) % shards


def shard_name(index: int) -> str:
    return f"m{index}"


def shards_of(machines: Mapping[str, MachineState], shards: int) -> list[dict[str, MachineState]]:
    """The machines by shard (each in the job's order)."""
    out: list[dict[str, MachineState]] = [{} for _ in range(shards)]
    for name, machine in machines.items():
        out[shard_of(name, shards)][name] = machine
    return out


def _partial(
    state: ClusterState,
    machines: dict[str, MachineState] | None = None,
    handled: dict[str, str] | None = None,
) -> ClusterState:
    # Built from values already validated: construct, not validate again.
    return ClusterState.model_construct(
        job=state.job, layout=state.layout, machines=machines or {}, handled=handled or {}
    )


def rest_piece(state: ClusterState) -> ClusterState:
    return state.model_copy(update={"machines": {}, "handled": {}})


def handled_piece(state: ClusterState) -> ClusterState:
    return _partial(state, handled=state.handled)


def machine_piece(state: ClusterState, machines: dict[str, MachineState]) -> ClusterState:
    return _partial(state, machines=machines)


def split(state: ClusterState) -> tuple[int, dict[str, ClusterState]]:
    """`state` as its number of shards and its pieces (piece name -> partial state)."""
    shards = shard_count(len(state.machines))
    pieces = {REST: rest_piece(state), HANDLED: handled_piece(state)}
    for i, machines in enumerate(shards_of(state.machines, shards)):
        pieces[shard_name(i)] = machine_piece(state, machines)
    return shards, pieces


def join(head: ClusterStateHead, pieces: Mapping[str, ClusterState]) -> ClusterState:
    """The whole state from the pieces `head` names; MessageError when one is missing
    or belongs to another job. Its machines come shard by shard (each shard in the
    writer's order): nothing reads meaning into the order of the machines."""
    wanted = {REST, HANDLED, *(shard_name(i) for i in range(head.shards))}
    missing = wanted - set(pieces)
    if missing or set(head.pieces) != wanted:
        raise MessageError(f"cluster state head {head.revision}: pieces {sorted(missing)} missing")
    if any(p.job != head.job for p in pieces.values()):
        raise MessageError(f"cluster state head {head.revision}: a piece of another job")
    machines: dict[str, MachineState] = {}
    for i in range(head.shards):
        machines.update(pieces[shard_name(i)].machines)
    return pieces[REST].model_copy(
        update={"machines": machines, "handled": pieces[HANDLED].handled}
    )


def chunks(raw: bytes, size: int = CHUNK_BYTES) -> list[bytes]:
    """`raw` in values of at most `size` bytes (at least one, for an empty piece)."""
    return [raw[i : i + size] for i in range(0, len(raw), size)] or [b""]


def decode_piece(raw: bytes) -> ClusterState:
    """A piece's joined chunks as a partial state; MessageError when invalid. A piece may
    be larger than one message (its chunks are not), so the size check is the chunks'."""
    if len(raw) <= MAX_MESSAGE_BYTES:
        return decode(ClusterState, raw)
    try:
        return ClusterState.model_validate_json(raw)
    except ValidationError as err:
        raise MessageError(f"cluster state piece: {err.errors()[0]['msg']}") from None
