"""A typical torchrun DDP training script: the starting point of `train_trainmover.py`.

Run with ``torchrun --nproc-per-node 2 -m trainmover.examples.ddp.train --steps 20``.
A small MLP with dropout, AdamW, a `DistributedSampler`-style data order (a permutation
per epoch from the seed, strided by rank) and gradient accumulation with `no_sync`.
The building blocks (`Settings`, `build`, `train_step`) are what the TrainMover version
imports unchanged; only `main` differs.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass(frozen=True)
class Settings:
    steps: int = 40
    seed: int = 1234
    lr: float = 3e-3
    width: int = 32
    depth: int = 4
    micro_batches: int = 2
    micro_batch_size: int = 4
    samples: int = 512


class ShardedOrder:
    """This rank's share of a fixed synthetic dataset, in the order DistributedSampler
    uses: a permutation per epoch seeded by (seed, epoch), every world_size-th index from
    `rank`. Its position is its state (`state_dict`), so a resumed run continues it."""

    def __init__(self, s: Settings, rank: int, world: int):
        gen = torch.Generator().manual_seed(s.seed)
        self.x = torch.randn(s.samples, s.width, generator=gen)
        teacher = torch.randn(s.width, s.width, generator=gen) / s.width**0.5
        self.y = torch.tanh(self.x @ teacher)
        self.seed, self.rank, self.world, self.batch = s.seed, rank, world, s.micro_batch_size
        self.epoch, self.cursor = 0, 0

    def _indices(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.x), generator=gen)[self.rank :: self.world]

    def next_batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self._indices()
        if self.cursor + self.batch > len(indices):
            self.epoch, self.cursor = self.epoch + 1, 0
            indices = self._indices()
        batch = indices[self.cursor : self.cursor + self.batch]
        self.cursor += self.batch
        return self.x[batch].to(device), self.y[batch].to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]


class MLP(torch.nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(s.width),
                torch.nn.Linear(s.width, 4 * s.width),
                torch.nn.GELU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(4 * s.width, s.width),
            )
            for _ in range(s.depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def build(s: Settings, device: torch.device) -> tuple[DDP, torch.optim.Optimizer, ShardedOrder]:
    """The DDP model (over the default group), its optimizer and this rank's data."""
    torch.manual_seed(s.seed)
    model = DDP(MLP(s).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr)
    data = ShardedOrder(s, dist.get_rank(), dist.get_world_size())
    return model, optimizer, data


def train_step(
    model: DDP, optimizer: torch.optim.Optimizer, data: ShardedOrder, s: Settings
) -> float:
    """One optimizer step over `micro_batches` accumulated micro-batches."""
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for micro in range(s.micro_batches):
        x, y = data.next_batch(device)
        # Gradients are all-reduced once, with the last micro-batch's backward.
        with model.no_sync() if micro < s.micro_batches - 1 else nullcontext():
            loss = F.mse_loss(model(x), y) / s.micro_batches
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def settings_from_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=Settings.steps)
    return Settings(steps=parser.parse_args(argv).steps)


def main() -> int:
    s = settings_from_args()
    dist.init_process_group()
    model, optimizer, data = build(s, device_for(int(os.environ.get("LOCAL_RANK", "0"))))
    for step in range(1, s.steps + 1):
        loss = train_step(model, optimizer, data, s)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
