"""The reference workload's model: a GPT-style decoder split by TP inside a machine and
by PP across machines.

Tensor parallelism follows Megatron: attention heads and the MLP's hidden units are split
over the TP group; a column-parallel linear takes a replicated input (its input gradient is
summed over TP in backward) and a row-parallel linear produces partial sums (summed over
TP in forward). Everything between them (layer norms, residual stream, embedding, head) is
replicated, so its gradients are equal on every TP rank. The TP sums are standard
`torch.distributed.all_reduce` calls on the role's c10d TP group
(`rt.process_group("tp")`), the one group type user code gets too.

Weights are drawn from the full (unsplit) tensor with a generator seeded by (seed, layer,
name), then sliced, so every layout of the same config starts from the same model, and DP
replicas start equal. The group is looked up through `group_of` at call time (inside a
standby's shadow iterations it is the sandbox's); a switch replaces what the stable c10d
group forwards to, so the model is never rebuilt.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainmover.runtime.config import ModelConfig
from trainmover.runtime.layout import Layout, Role

GroupOf = Callable[[], dist.ProcessGroup]


def _seeded(seed: int, *tags: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr((seed, *tags)).encode()) + seed)


def _normal(shape: tuple[int, ...], seed: int, *tags: object) -> torch.Tensor:
    return torch.randn(shape, generator=_seeded(seed, *tags)) * 0.02


class _CopyToTP(torch.autograd.Function):
    """Identity forward; sums the input gradient over the TP group in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sums partial outputs over the TP group in forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


@torch.compiler.disable
def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group.size() > 1 else x


@torch.compiler.disable
def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group.size() > 1 else x


class TPLinear(nn.Module):
    """A linear layer holding this rank's slice: "column" splits outputs, "row" splits
    inputs. `weight` is the local slice, already cut from the full tensor."""

    def __init__(self, weight: torch.Tensor, mode: str, group_of: GroupOf):
        super().__init__()
        if mode not in ("column", "row"):
            raise ValueError(mode)
        self.mode = mode
        self.group_of = group_of
        self.weight = nn.Parameter(weight.contiguous())
        self.bias = nn.Parameter(torch.zeros(weight.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "column":
            return F.linear(copy_to_tp(x, self.group_of()), self.weight, self.bias)
        # The bias is added once, after the sum, not once per TP rank.
        return reduce_from_tp(F.linear(x, self.weight), self.group_of()) + self.bias


class Dropout(nn.Module):
    """Dropout drawing from an explicit generator, shared by the TP ranks of a machine so
    the replicated activations get the same mask everywhere; the generator's state is part
    of the role's training state."""

    def __init__(self, p: float, generator: torch.Generator):
        super().__init__()
        self.p = p
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(x.shape, generator=self.generator, device=x.device) >= self.p
        return x * keep / (1.0 - self.p)


class Block(nn.Module):
    """Pre-norm attention + MLP with this TP rank's heads and hidden units."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        seed: int,
        tp_rank: int,
        tp_size: int,
        group_of: GroupOf,
        dropout: Dropout,
    ):
        super().__init__()
        d, heads = cfg.d_model, cfg.n_heads
        self.head_dim = d // heads
        self.local_heads = heads // tp_size
        local = self.local_heads * self.head_dim
        rows = slice(tp_rank * local, (tp_rank + 1) * local)
        qkv = [_normal((d, d), seed, layer, name)[rows] for name in ("q", "k", "v")]
        proj = _normal((d, d), seed, layer, "proj")[:, rows]
        hidden = cfg.d_model * cfg.mlp_ratio
        hrows = slice(tp_rank * hidden // tp_size, (tp_rank + 1) * hidden // tp_size)
        fc1 = _normal((hidden, d), seed, layer, "fc1")[hrows]
        fc2 = _normal((d, hidden), seed, layer, "fc2")[:, hrows]

        self.ln1 = nn.LayerNorm(d)
        self.qkv = TPLinear(torch.cat(qkv), "column", group_of)
        self.proj = TPLinear(proj, "row", group_of)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = TPLinear(fc1, "column", group_of)
        self.fc2 = TPLinear(fc2, "row", group_of)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.local_heads * self.head_dim, dim=-1)
        q, k, v = (z.view(b, t, self.local_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim)
        x = x + self.dropout(self.proj(y))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class StageModel(nn.Module):
    """The layers of one pipeline stage, for one TP rank. The first stage embeds tokens,
    the last one ends in the LM head; in between, hidden states go in and out."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: Layout,
        role: Role,
        seed: int,
        group_of: GroupOf,
        generator: torch.Generator,
    ):
        super().__init__()
        self.first = role.pp == 0
        self.last = role.pp == layout.pp - 1
        per_stage = cfg.n_layers // layout.pp
        self.dropout = Dropout(cfg.dropout, generator)
        if self.first:
            self.tok = nn.Parameter(_normal((cfg.vocab_size, cfg.d_model), seed, "tok"))
            self.pos = nn.Parameter(_normal((cfg.seq_len, cfg.d_model), seed, "pos"))
        self.blocks = nn.ModuleList(
            Block(cfg, layer, seed, role.tp, layout.tp, group_of, self.dropout)
            for layer in range(role.pp * per_stage, (role.pp + 1) * per_stage)
        )
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Parameter(_normal((cfg.vocab_size, cfg.d_model), seed, "head"))
        if cfg.extra_state_bytes >= 4:
            # Distinct values per role (a misrouted chunk shows), equal across replicas.
            block = torch.arange(cfg.extra_state_bytes // 4, dtype=torch.float32)
            self.register_buffer("extra_state", block.add_(layout.tp * role.pp + role.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (first stage) or hidden states -> hidden states or logits (last stage)."""
        if self.first:
            x = self.dropout(self.tok[x] + self.pos[: x.shape[1]])
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = F.linear(self.ln_f(x), self.head)
        return x
