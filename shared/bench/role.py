"""One role of the reference job, built outside TrainMover for the baseline systems.

The checkpoint-restart and torchft baselines must train *the same job* as TrainMover:
same model, initial weights, dropout stream, data and optimizer for a role. This builds
them with `trainmover.runtime.reference.build` itself, and writes the per-step event
lines the harnesses read.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainmover.runtime.c10d import SwappableGroup
from trainmover.runtime.config import JobConfig
from trainmover.runtime.data import TokenStream
from trainmover.runtime.groups import Group
from trainmover.runtime.layout import GroupKind, Role
from trainmover.runtime.model import GroupOf, StageModel
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.reference import RoleJob, build
from trainmover.runtime.state import TrainingState


@dataclass
class RoleTraining:
    """A role of the reference job (`job.step(groups, step)` trains exactly as it does)
    and the state that tracks it."""

    job: RoleJob
    state: TrainingState

    @property
    def model(self) -> StageModel:
        return self.job.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.job.optimizer

    @property
    def data(self) -> TokenStream:
        return self.job.data


CPU = torch.device("cpu")


def build_role(
    cfg: JobConfig, role: Role, tp_group: GroupOf, device: torch.device = CPU
) -> RoleTraining:
    """Model, optimizer and data of `role`, built and seeded as the reference job builds
    them. `tp_group` returns the role's c10d TP group."""
    torch.manual_seed(cfg.train.seed)
    job = build(cfg, role, tp_group, device)
    state = TrainingState(job.model, job.optimizer, {"data": job.data}, {"dropout": job.dropout})
    return RoleTraining(job, state)


def solo_group(kind: GroupKind, name: str) -> dist.ProcessGroup:
    """A c10d group of one (no backend: the reference job makes no collective on a group
    of size 1), for a layout dimension of size 1 inside a baseline's replica."""
    spec = GroupSpec(
        name=name, kind=kind, generation=0, members=[RankRef(machine="solo", local_rank=0)]
    )
    solo = Group(spec, rank=0, backend=None, build_s=0.0)
    return SwappableGroup(name, 0, 1, lambda: solo)


class EventWriter:
    """Appends one JSON object per line (flushed) for the benchmark harness to read."""

    def __init__(self, path: Path, **fields: Any):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)
        self._fields = {"pid": os.getpid(), **fields}

    def write(self, event: str, **fields: Any) -> None:
        self._file.write(
            json.dumps({"event": event, "t": time.time(), **self._fields, **fields}) + "\n"
        )

    def close(self) -> None:
        self._file.close()


def read_events(folder: Path) -> list[dict[str, Any]]:
    """Every event line written under `folder` (complete lines only), in time order."""
    events = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line still being written
    return sorted(events, key=lambda e: e["t"])
