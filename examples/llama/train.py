"""A torchtitan-style torchrun script: the Llama decoder of `model.py` trained with FSDP2
(HSDP when the data-parallel ranks are both replicated and sharded), DTensor tensor
parallelism and `torch.distributed.pipelining` on one `DeviceMesh`.

Run with ``torchrun --nproc-per-node 8 -m trainmover.examples.llama.train --pp 2
--dp-shard 2 --tp 2 --steps 20``. The building blocks (`Settings`, `build`, `train_step`,
`TokenData`) are what the TrainMover version imports unchanged; only `main` differs.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainmover.examples.llama.model import ModelArgs, Transformer, pipeline_stage

#: The mesh's dimensions, outermost first, as torchtitan orders them.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

#: Tensor parallelism inside a block (Megatron-style): the heads and the feed-forward's
#: hidden units split across the TP ranks, one all-reduce after attention and one after
#: the feed-forward; norms and embeddings replicated.
TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}


@dataclass(frozen=True)
class Settings:
    steps: int = 40
    seed: int = 1234
    lr: float = 3e-3
    model: ModelArgs = ModelArgs()
    micro_batch_size: int = 4
    samples: int = 256
    #: With PP: how many pieces each batch is cut into, and the schedule that runs them.
    microbatches: int = 2
    schedule: Literal["1F1B", "GPipe"] = "1F1B"
    #: Mesh sizes; a size-1 dimension is left out of the mesh.
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def mesh_shape(self) -> dict[str, int]:
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate}
        sizes |= {"dp_shard": self.dp_shard, "tp": self.tp}
        return {d: sizes[d] for d in MESH_DIMS if sizes[d] > 1}


class TokenData:
    """This data-parallel rank's share of a fixed synthetic token dataset (sequences that
    follow a random first-order chain, so there is something to learn): a permutation
    per epoch seeded by (seed, epoch), every `replicas`-th index from `index`. Every
    tensor- and pipeline-parallel rank of one data-parallel index reads the same
    batches. Its position is its state, so a resumed run continues it."""

    def __init__(self, s: Settings, index: int, replicas: int):
        gen = torch.Generator().manual_seed(s.seed)
        vocab, seq = s.model.vocab_size, s.model.seq_len + 1
        chain = torch.randint(vocab, (vocab, 2), generator=gen)
        tokens = torch.empty(s.samples, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (s.samples,), generator=gen)
        for i in range(1, seq):
            pick = torch.randint(2, (s.samples,), generator=gen)
            tokens[:, i] = chain[tokens[:, i - 1], pick]
        self.tokens = tokens
        self.seed, self.index, self.replicas = s.seed, index, replicas
        self.batch = s.micro_batch_size
        self.epoch, self.cursor = 0, 0

    def _indices(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.tokens), generator=gen)[self.index :: self.replicas]

    def next_batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self._indices()
        if self.cursor + self.batch > len(indices):
            self.epoch, self.cursor = self.epoch + 1, 0
            indices = self._indices()
        rows = self.tokens[indices[self.cursor : self.cursor + self.batch]]
        self.cursor += self.batch
        return rows[:, :-1].to(device), rows[:, 1:].to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel size) from the mesh."""
    index, size = 0, 1
    for dim in ("dp_replicate", "dp_shard"):
        if dim in (mesh.mesh_dim_names or ()):
            index = index * mesh[dim].size() + mesh.get_local_rank(dim)
            size *= mesh[dim].size()
    return index, size


@dataclass
class Trainer:
    """What `build` makes for one rank: its model (with PP, its stage's share), the
    optimizer, the data, and with PP the schedule that runs the stage."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: TokenData
    schedule: PipelineScheduleSingle | None = None
    is_first: bool = True
    is_last: bool = True
    #: The one rank that prints the loss (the last stage's, at every other coordinate 0).
    reports_loss: bool = True


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build(s: Settings, mesh: DeviceMesh, device: torch.device) -> Trainer:
    """The model (cut to this rank's pipeline stage) sharded over the mesh's data-parallel
    dimensions, its optimizer, this rank's data and its pipeline schedule. Every rank
    initialises the whole model from the seed, then cuts and shards it."""
    names = mesh.mesh_dim_names or ()
    if s.dp_replicate > 1 and s.dp_shard == 1:
        raise ValueError("replicated data parallelism here is HSDP: give --dp-shard > 1")
    torch.manual_seed(s.seed)
    model = Transformer(s.model).to(device)
    stage = mesh.get_local_rank("pp") if "pp" in names else 0
    if "pp" in names:
        pipeline_stage(model, stage, s.pp)
    if "tp" in names:
        for layer in model.layers.values():
            # Every rank initialised the whole model alike: each keeps its slice, no
            # collective (src_data_rank=None).
            parallelize_module(layer, mesh["tp"], TP_PLAN, src_data_rank=None)
    dp_dims = tuple(d for d in ("dp_replicate", "dp_shard") if d in names)
    if dp_dims:
        dp_mesh = mesh[dp_dims]
        for layer in model.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr)
    coordinate = dict(zip(names, mesh.get_coordinate() or [], strict=True))
    trainer = Trainer(
        model,
        optimizer,
        TokenData(s, *dp_coordinates(mesh)),
        is_first=stage == 0,
        is_last=stage == s.pp - 1,
        reports_loss=all(c == (s.pp - 1 if d == "pp" else 0) for d, c in coordinate.items()),
    )
    if "pp" in names:
        pipe = PipelineStage(model, stage, s.pp, device, group=mesh["pp"].get_group())
        trainer.schedule = SCHEDULES[s.schedule](pipe, s.microbatches, loss_fn=loss_fn)
    return trainer


def train_step(t: Trainer, s: Settings) -> float | None:
    """One optimizer step on one batch (with PP, in `s.microbatches` pieces through the
    pipeline); the loss, on the ranks of the last stage (None on the others)."""
    device = next(t.model.parameters()).device
    t.optimizer.zero_grad(set_to_none=True)
    inputs, targets = t.data.next_batch(device)
    loss: float | None = None
    if t.schedule is None:
        value = loss_fn(t.model(inputs), targets)
        value.backward()
        loss = value.item()
    else:
        losses: list[torch.Tensor] = []
        args = (inputs,) if t.is_first else ()
        if t.is_last:
            t.schedule.step(*args, target=targets, losses=losses)
            loss = torch.stack(losses).mean().item()
        else:
            t.schedule.step(*args)
    t.optimizer.step()
    return loss


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def settings_from_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--microbatches", type=int, default=Settings.microbatches)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default=Settings.schedule)
    for dim in MESH_DIMS:
        parser.add_argument(f"--{dim.replace('_', '-')}", type=int, default=1)
    args = parser.parse_args(argv)
    return Settings(
        steps=args.steps,
        microbatches=args.microbatches,
        schedule=args.schedule,
        **{d: getattr(args, d) for d in MESH_DIMS},
    )


def main() -> int:
    s = settings_from_args()
    dist.init_process_group()
    device = device_for(int(os.environ.get("LOCAL_RANK", "0")))
    shape = s.mesh_shape()
    mesh = init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    t = build(s, mesh, device)
    for step in range(1, s.steps + 1):
        loss = train_step(t, s)
        if t.reports_loss and loss is not None:
            print(f"step {step} loss {loss:.6f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
