"""A small Llama-style decoder, written as a torchtitan user writes one.

RMSNorm before attention and before the feed-forward, rotary position embeddings
(applied in real arithmetic: a cos/sin table, so no complex tensors travel), causal
multi-head attention through `scaled_dot_product_attention`, a SwiGLU feed-forward, and
tied or untied input/output embeddings. Layers sit in a `ModuleDict` keyed by their
index, so a pipeline stage keeps the global names of the layers it holds
(`pipeline_stage`); attention reads its local number of heads from its projections, so
a tensor-parallel rank that holds a slice of the heads runs the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 64
    ffn_dim: int = 64
    seq_len: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False


def rope_table(args: ModelArgs) -> torch.Tensor:
    """(seq_len, head_dim) cos and sin of each position's rotation, stacked on dim 0."""
    head_dim = args.dim // args.n_heads
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(args.seq_len).float(), inv)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotates each (even, odd) pair of `x` (batch, seq, heads, head_dim) by its angle."""
    cos, sin = table[0][: x.shape[1], None, :], table[1][: x.shape[1], None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: a tensor-parallel rank holds a slice of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids in, logits out."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope", rope_table(args), persistent=False)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small normal weights, scaled down on the residual branches' outputs."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            scale = (
                (2 * self.args.n_layers) ** -0.5 if name.endswith(("wo.weight", "w2.weight")) else 1
            )
            nn.init.normal_(p, std=std * scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids to logits; a pipeline stage without the embeddings takes hidden
        states, and one without the output returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h)) if self.output is not None else h


def pipeline_stage(model: Transformer, stage: int, stages: int) -> Transformer:
    """`model` cut down to pipeline stage `stage` of `stages`, in place: an even share
    of the blocks, the embeddings only on the first stage, the final norm and the output
    only on the last (torchtitan's manual split)."""
    if model.args.tie_embeddings and stages > 1:
        raise ValueError("tied embeddings live on the first and the last stage: untie them")
    n = model.args.n_layers
    if n < stages:
        raise ValueError(f"{n} layers cannot fill {stages} pipeline stages")
    keep = range(stage * n // stages, (stage + 1) * n // stages)
    for name in list(model.layers):
        if int(name) not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None  # type: ignore[assignment]
    if stage < stages - 1:
        model.norm = None  # type: ignore[assignment]
        model.output = None  # type: ignore[assignment]
    return model
