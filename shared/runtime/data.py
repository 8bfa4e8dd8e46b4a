"""A deterministic, learnable synthetic token stream with an explicit position.

Sample i is an arithmetic progression modulo the vocabulary whose start and stride are a
pure function of (seed, i): the next token is predictable from the previous two, so the
loss falls quickly. Because samples are addressed by index, a reader's whole state is its
position, which a joiner receives with the rest of the role's state and continues from.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1
STRIDES = (1, 2, 3, 5)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def sample(seed: int, index: int, seq_len: int, vocab_size: int) -> list[int]:
    """Sample `index` of the stream: seq_len + 1 tokens (inputs plus the shifted target)."""
    h = _splitmix64((seed << 32) ^ index)
    start, stride = h % vocab_size, STRIDES[(h >> 32) % len(STRIDES)]
    return [(start + stride * i) % vocab_size for i in range(seq_len + 1)]


class TokenStream:
    """One DP replica's reader. Step s of the job consumes global samples
    [s * global_batch, (s + 1) * global_batch); replica d takes its contiguous share."""

    def __init__(
        self,
        seed: int,
        seq_len: int,
        vocab_size: int,
        local_batch: int,
        dp_rank: int,
        dp_size: int,
    ):
        self.seed, self.seq_len, self.vocab_size = seed, seq_len, vocab_size
        self.local_batch, self.dp_rank, self.dp_size = local_batch, dp_rank, dp_size
        #: Index of the next global sample block (one per training step).
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [local_batch, seq_len] int64; advances the position."""
        first = self.position * self.local_batch * self.dp_size + self.dp_rank * self.local_batch
        rows = [
            sample(self.seed, first + i, self.seq_len, self.vocab_size)
            for i in range(self.local_batch)
        ]
        self.position += 1
        tokens = torch.tensor(rows, dtype=torch.int64)
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
