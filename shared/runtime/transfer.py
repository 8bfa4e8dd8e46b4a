"""Streamed peer transfer of a role's state over a transfer pair, in bounded chunks.

The sender writes a manifest (JSON: the non-tensor header, each tensor's name, shape and
dtype, the chunk size) and then every tensor's bytes in chunks of at most `chunk_bytes`,
a few posted at a time: the small tensors packed together, the others straight from
their own storage (`trainmover.runtime.pieces`); last, one checksum per chunk.
The receiver checks the manifest against its own model before it receives any tensor
byte, then receives each tensor into the storage it will live in: its own parameter or
optimizer tensor of the same shape and dtype (so a joiner that built its role holds no
second copy of the state), or a fresh tensor where it has none yet (an optimizer that has
not stepped, the RNG states). Nothing is applied here: the caller restores the header
(step, data position, RNGs, optimizer) only after every chunk arrived and matched its
checksum, so a transfer cut mid-way (the sender killed) or corrupted raises and leaves
the receiver's step, optimizer and RNGs as they were; only tensor bytes it never trained
with were overwritten, and the next transfer overwrites them all.

A pack, and a tensor on another device than the pair's (a CPU RNG state beside NCCL
groups, a CPU offloaded moment), travel through one staging buffer of one chunk on the
pair's device. Peak memory on either side is therefore the state itself plus that buffer
(and a copy of one non-contiguous tensor at a time), whatever the state's size.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainmover.runtime import fault
from trainmover.runtime.groups import Group, PendingWork
from trainmover.runtime.pieces import Piece, Staging, cut

#: Default largest chunk of one send or receive.
CHUNK_BYTES = 64 * 1024 * 1024
#: Chunks posted and not yet completed, per side: enough to keep the link busy while
#: a chunk's checksum is computed.
WINDOW = 4
_TAG_SIZES, _TAG_MANIFEST, _TAG_SUMS = 0, 1, 2
#: Chunk i goes under tag _TAG_DATA + i % LANES: gloo maps a tag to one of a pair's
#: connections (tag modulo their number), so consecutive chunks take turns over them;
#: with fewer connections the tags still keep each lane's chunks in order.
_TAG_DATA, LANES = 8, 8
_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


class TransferError(RuntimeError):
    """A state transfer that did not arrive whole: the state was not applied."""


@dataclass
class TransferStats:
    """What one side of a transfer moved. `seconds` runs from the sender's first byte
    (its manifest) to the last chunk checked; a receiver that was ready first waited
    `waited_s` before that (on the sender reaching its switch), which is not transfer."""

    bytes: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    chunks: int = 0
    waited_s: float = 0.0


@dataclass
class Received:
    """A state received whole and checked, not yet applied."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    stats: TransferStats


def send_state(
    group: Group,
    peer: int,
    header: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    extra: dict[str, Any] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    checksums: bool = True,
) -> TransferStats:
    """Streams `tensors` (and the JSON `header`, with the runtime's own `extra`) to `peer`
    of the pair; with `checksums`, one per chunk after the last."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    started = time.perf_counter()
    manifest = {
        "header": header,
        "extra": extra or {},
        "chunk_bytes": chunk_bytes,
        "checksums": checksums,
        "tensors": [[n, list(t.shape), _dtype_name(t.dtype)] for n, t in tensors.items()],
    }
    raw = _bytes_tensor(json.dumps(manifest).encode(), device)
    size = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    group.send(size, peer, _TAG_SIZES).wait()
    group.send(raw, peer, _TAG_MANIFEST).wait()
    sums: list[int] = []
    posted: deque[PendingWork] = deque()
    staging = Staging(device, chunk_bytes)
    flat = _Flats(list(tensors.values()))
    total = chunks = 0
    for piece in cut(flat.sizes, chunk_bytes):
        wire = staging.outgoing(piece, flat, posted)
        posted.append(group.send(wire, peer, _TAG_DATA + chunks % LANES))
        if checksums:  # read while the chunk is on the wire: both only read it
            sums.append(_checksum(wire, chunks))
        total, chunks = total + wire.numel(), chunks + 1
        if chunks == 1:  # the first send posted (a small state is one pack): not all sent
            fault.point("transfer")  # test-only: the sender dies mid-transfer
        while len(posted) > WINDOW:
            posted.popleft().wait()
    while posted:
        posted.popleft().wait()
    if checksums:
        group.send(torch.tensor(sums, dtype=torch.int64, device=device), peer, _TAG_SUMS).wait()
    return TransferStats(bytes=total, seconds=time.perf_counter() - started, chunks=chunks)


def receive_state(
    group: Group, peer: int, own: dict[str, torch.Tensor], device: torch.device
) -> Received:
    """Receives what `send_state` streams from `peer` into `own`'s tensors where they
    match; raises `ValueError` before any tensor byte if the sender's role is not ours,
    `TransferError` if a chunk does not match its checksum (and the pair's error if the
    sender stops mid-way)."""
    ready = time.perf_counter()
    size = torch.empty(1, dtype=torch.int64, device=device)
    group.recv(size, peer, _TAG_SIZES)
    started = time.perf_counter()
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.recv(raw, peer, _TAG_MANIFEST)
    manifest = json.loads(bytes(raw.cpu().numpy()).decode())
    header, extra = manifest["header"], manifest.get("extra", {})
    chunk_bytes, checksums = int(manifest["chunk_bytes"]), bool(manifest["checksums"])
    tensors = _destinations(manifest["tensors"], own, device)
    sums: list[int] = []
    #: (work, what it receives into, the piece if that is the staging buffer)
    posted: deque[tuple[PendingWork, torch.Tensor, Piece | None]] = deque()
    staging = Staging(device, chunk_bytes)
    flat = _Flats(list(tensors.values()))
    total = chunks = 0

    def complete() -> None:
        work, wire, staged = posted.popleft()
        work.wait()
        if checksums:
            sums.append(_checksum(wire, len(sums)))
        if staged is not None:
            staging.scatter(wire, staged, flat)

    for piece in cut(flat.sizes, chunk_bytes):
        staged = staging.needed(piece, flat)
        if staged:
            while posted:  # the one staging buffer is free again
                complete()
        wire = staging.incoming(piece, flat)
        lane = _TAG_DATA + chunks % LANES
        posted.append((group.irecv(wire, peer, lane), wire, piece if staged else None))
        total, chunks = total + wire.numel(), chunks + 1
        while len(posted) > WINDOW:
            complete()
    while posted:
        complete()
    if checksums:
        _check(group, peer, sums, device)
    stats = TransferStats(
        bytes=total,
        seconds=time.perf_counter() - started,
        extra=extra,
        chunks=chunks,
        waited_s=started - ready,
    )
    return Received(header=header, tensors=tensors, stats=stats)


def _check(group: Group, peer: int, sums: list[int], device: torch.device) -> None:
    """Compares our checksums with the sender's, which follow its last chunk."""
    expected = torch.empty(len(sums), dtype=torch.int64, device=device)
    group.recv(expected, peer, _TAG_SUMS)
    bad = [i for i, (a, b) in enumerate(zip(sums, expected.tolist(), strict=True)) if a != b]
    if bad:
        raise TransferError(
            f"{len(bad)} of {len(sums)} chunks failed their checksum (first: {bad[0]})"
        )


def _destinations(
    manifest: list[list[Any]], own: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Where each incoming tensor is written: our own tensor of the same shape and dtype,
    else a fresh one. The sender must have built the same role: same parameter names and
    shapes and dtypes (our optimizer may not have state yet, so only the model part must
    match); the error names the first difference."""
    incoming = {name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in manifest}
    for name, t in own.items():
        if not name.startswith("model."):
            continue
        theirs = incoming.get(name)
        if theirs != (tuple(t.shape), t.dtype):
            sent = "nothing" if theirs is None else f"{list(theirs[0])} {theirs[1]}"
            raise ValueError(
                f"state mismatch at {name}: the joiner built {list(t.shape)} {t.dtype}, the "
                f"sender sent {sent} (a different role)"
            )
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in incoming.items():
        mine = own.get(name)
        reusable = (
            mine is not None
            and tuple(mine.shape) == shape
            and mine.dtype == dtype
            and mine.is_contiguous()
            and not name.startswith("rng.")  # RNG states are copies: restored, not shared
        )
        out[name] = (
            mine
            if reusable and mine is not None
            else torch.empty(shape, dtype=dtype, device=device)
        )
    return out


class _Flats:
    """Each tensor's bytes as a flat view (`as_bytes`), the last one kept: a
    non-contiguous tensor is copied once for all its chunks, and one at a time."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self._last: tuple[int, torch.Tensor] | None = None

    def __call__(self, index: int) -> torch.Tensor:
        if self._last is None or self._last[0] != index:
            self._last = (index, as_bytes(self._tensors[index]))
        return self._last[1]


def _checksum(chunk: torch.Tensor, index: int) -> int:
    """A cheap per-chunk checksum (a wrapping sum of the chunk's 8-byte words and its tail
    bytes, mixed with the chunk's index and length): catches a missing, truncated, zeroed
    or misplaced chunk at memory speed. Bit errors on the wire are TCP's and NCCL's to
    catch. Defined on the bytes alone, so both ends agree whatever their alignment."""
    n = chunk.numel()
    words = n // 8
    body, tail = chunk[: words * 8], chunk[words * 8 :]
    if body.data_ptr() % 8:
        body = body.clone()  # one chunk at most, only where storage is unaligned
    if chunk.device.type == "cpu":
        # numpy on the calling thread: torch's intra-op pool, woken for every chunk, costs
        # more than the sum itself on a host whose cores move the bytes.
        total = int(body.numpy().view(np.uint64).sum(dtype=np.uint64))
        total += int(tail.numpy().sum(dtype=np.uint64))
    else:
        total = int(body.view(torch.int64).sum().item()) if words else 0
        total += int(tail.to(torch.int64).sum().item()) if n % 8 else 0
    return (total + _MIX * (index + 1) + n) & _MASK


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
