"""How a state transfer is cut into sends (`trainmover.runtime.pieces`): pure."""

from __future__ import annotations

import random

import pytest

from trainmover.runtime.pieces import PACK_BELOW, Piece, cut

MIB = 1 << 20


def covered(pieces: list[Piece]) -> dict[int, list[tuple[int, int]]]:
    """Tensor index -> the byte ranges the pieces send of it, in sending order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for piece in pieces:
        for index, start, end in piece.spans:
            out.setdefault(index, []).append((start, end))
    return out


def test_small_tensors_go_first_packed_and_large_ones_in_views_of_a_chunk() -> None:
    sizes = [4, 3 * MIB, 100, 0, 8, 64]
    pieces = cut(sizes, chunk_bytes=MIB)
    assert pieces[0] == Piece(((0, 0, 4), (2, 0, 100), (4, 0, 8), (5, 0, 64)), packed=True)
    assert pieces[1:] == [Piece(((1, s, s + MIB),)) for s in (0, MIB, 2 * MIB)]


def test_packs_hold_at_most_a_chunk_and_a_lone_small_tensor_is_sent_as_it_is() -> None:
    pieces = cut([60, 60, 60, 500], chunk_bytes=128)
    assert pieces == [
        Piece(((0, 0, 60), (1, 0, 60)), packed=True),
        Piece(((2, 0, 60),)),  # alone in its pack: no copy
        Piece(((3, 0, 128),)), Piece(((3, 128, 256),)),
        Piece(((3, 256, 384),)), Piece(((3, 384, 500),)),
    ]  # fmt: skip
    assert all(p.nbytes <= 128 for p in pieces)


def test_a_tensor_of_the_pack_limit_or_more_is_not_packed_whatever_the_chunk() -> None:
    (piece,) = cut([PACK_BELOW], chunk_bytes=64 * MIB)
    assert piece == Piece(((0, 0, PACK_BELOW),))


@pytest.mark.parametrize("seed", range(20))
def test_every_byte_of_every_tensor_is_sent_once_in_order(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 7, 64, 4096, 3 * MIB // 2, 5 * MIB]) for _ in range(30)]
    chunk = rng.choice([13, 4096, MIB, 4 * MIB])
    pieces = cut(sizes, chunk)
    assert all(0 < p.nbytes <= chunk for p in pieces)
    spans = covered(pieces)
    for index, size in enumerate(sizes):
        ranges = spans.get(index, [])
        if size == 0:
            assert ranges == []
            continue
        # Contiguous, in order, from 0 to the tensor's end.
        assert [r[0] for r in ranges] == [0, *(r[1] for r in ranges[:-1])]
        assert ranges[-1][1] == size
