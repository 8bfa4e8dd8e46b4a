"""How a state transfer is cut into sends (`trainmover.runtime.transfer`).

Both ends cut the stream the same way from the manifest alone (each tensor's size in
bytes and the chunk size), so a send carries no framing of its own:

- the tensors under `PACK_BELOW` bytes (under a chunk, where chunks are smaller) go
  first, copied together into packs of at most a chunk: each send costs about a round
  trip, which for the hundreds of small tensors of a model (norms, biases, their
  optimizer moments and step counters, RNG states) outweighs their bytes;
- every other tensor goes as views of its own storage of at most a chunk, no copy.

A pack, and a chunk of a tensor on another device than the pair's (a CPU RNG state
beside NCCL groups), go through one staging buffer of one chunk on the pair's device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainmover.runtime.groups import PendingWork

#: Tensors smaller than this travel packed together.
PACK_BELOW = 1 << 20

#: One send's bytes: (tensor index in the manifest, start byte, end byte).
Span = tuple[int, int, int]
#: Tensor index -> that tensor's bytes as a flat uint8 view (`transfer.as_bytes`).
Flat = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class Piece:
    """One send: one span of one tensor, or (`packed`) several small tensors whole."""

    spans: tuple[Span, ...]
    packed: bool = False

    @property
    def nbytes(self) -> int:
        return sum(end - start for _, start, end in self.spans)


def cut(sizes: list[int], chunk_bytes: int) -> list[Piece]:
    """The sends of a stream of tensors of `sizes` bytes, in order."""
    small = min(PACK_BELOW, chunk_bytes)
    packs: list[list[Span]] = []
    filled = chunk_bytes
    for index, size in enumerate(sizes):
        if 0 < size < small:
            if filled + size > chunk_bytes:
                packs.append([])
                filled = 0
            packs[-1].append((index, 0, size))
            filled += size
    pieces = [Piece(tuple(spans), packed=len(spans) > 1) for spans in packs]
    for index, size in enumerate(sizes):
        if size >= small:
            pieces += [
                Piece(((index, start, min(size, start + chunk_bytes)),))
                for start in range(0, size, chunk_bytes)
            ]
    return pieces


class Staging:
    """The one chunk-sized buffer on the pair's device, allocated at its first use."""

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        self.device, self.chunk_bytes = device, chunk_bytes
        self._buffer: torch.Tensor | None = None

    def needed(self, piece: Piece, flat: Flat) -> bool:
        return piece.packed or flat(piece.spans[0][0]).device != self.device

    def _view(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device)
        return self._buffer[:nbytes]

    def outgoing(self, piece: Piece, flat: Flat, posted: deque[PendingWork]) -> torch.Tensor:
        """What the sender sends for `piece`: a view of its tensor, or the buffer filled."""
        if not self.needed(piece, flat):
            index, start, end = piece.spans[0]
            return flat(index)[start:end]
        while posted:  # the buffer may still be on the wire
            posted.popleft().wait()
        view = self._view(piece.nbytes)
        offset = 0
        for index, start, end in piece.spans:
            view[offset : offset + end - start].copy_(flat(index)[start:end])
            offset += end - start
        return view

    def incoming(self, piece: Piece, flat: Flat) -> torch.Tensor:
        """Where the receiver receives `piece`: its tensor's own bytes, or the buffer
        (then `scatter` once it arrived; the caller waits for the buffer to be free)."""
        if self.needed(piece, flat):
            return self._view(piece.nbytes)
        index, start, end = piece.spans[0]
        return flat(index)[start:end]

    @staticmethod
    def scatter(wire: torch.Tensor, piece: Piece, flat: Flat) -> None:
        """Copies a piece received into the buffer to its tensors."""
        offset = 0
        for index, start, end in piece.spans:
            flat(index)[start:end].copy_(wire[offset : offset + end - start])
            offset += end - start
