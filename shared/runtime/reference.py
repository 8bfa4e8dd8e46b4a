"""The reference job: a 3D-parallel GPT-style decoder trained under TrainMover.

Run by the launcher as ``python -m trainmover.runtime.reference`` in every worker
process (active or standby). It is also the example of the integration surface: apart
from building its model (`build`, which a standby also uses for shadow iterations), the
loop only calls `Runtime` a handful of times.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainmover.runtime.config import JobConfig
from trainmover.runtime.data import TokenStream
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Role
from trainmover.runtime.model import GroupOf, StageModel
from trainmover.runtime.train_step import GroupsOf, train_step
from trainmover.runtime.worker import Runtime


def warm_up() -> None:
    """What a standby can do before it has a role: the first Adam construction imports
    torch._dynamo (~1.5 s), which would otherwise land on the migration's critical path."""
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


@dataclass
class RoleJob:
    """One role's model, optimizer, data reader and dropout generator."""

    cfg: JobConfig
    role: Role
    model: StageModel
    optimizer: torch.optim.Optimizer
    data: TokenStream
    dropout: torch.Generator

    def step(self, group: GroupsOf, step: int) -> float | None:
        """One training step over the role's c10d groups (`group(kind)`)."""
        # Dropout draws from a generator reseeded from (role, step): a role's masks are
        # the same whoever plays it, so a joiner restored from a DP replica (whose own
        # generator differs) continues exactly.
        lay = self.cfg.layout
        self.dropout.manual_seed(
            (self.cfg.train.seed * 1_000_003 + (self.role.dp * lay.pp + self.role.pp)) * 100_003
            + step
        )
        return train_step(
            self.model,
            self.optimizer,
            self.data.next_batch(),
            group,
            self.cfg.train.micro_batches,
            self.cfg.model.d_model,
        )


def build(cfg: JobConfig, role: Role, tp_group: GroupOf, device: torch.device) -> RoleJob:
    """The role's model, optimizer, data reader and dropout generator. `tp_group` returns
    the role's c10d TP group at call time (inside a shadow iteration, the sandbox's)."""
    dropout = torch.Generator(device=device)
    model = StageModel(cfg.model, cfg.layout, role, cfg.train.seed, tp_group, dropout).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)
    if cfg.train.compile:
        # Eager and compiled results differ numerically: a joiner runs the leaver's
        # mode because both read it from the same config.
        model.compile()
    data = TokenStream(
        seed=cfg.train.seed,
        seq_len=cfg.model.seq_len,
        vocab_size=cfg.model.vocab_size,
        local_batch=cfg.train.micro_batch_size * cfg.train.micro_batches,
        dp_rank=role.dp,
        dp_size=cfg.layout.dp,
    )
    return RoleJob(cfg, role, model, optimizer, data, dropout)


def main() -> int:
    with Runtime.from_env() as rt:
        cfg = rt.config
        warm_up()

        def shadow(role: Role, groups: GroupTable) -> Callable[[], object]:
            # rt.process_group hands out the sandbox's c10d groups here.
            job = build(cfg, role, lambda: rt.process_group("tp"), rt.device)
            steps = itertools.count(1)
            return lambda: job.step(rt.process_group, next(steps))

        role = rt.wait_for_role(shadow=shadow)
        if role is None:
            return 0  # a standby released without being used
        torch.manual_seed(cfg.train.seed)
        job = build(cfg, role, lambda: rt.process_group("tp"), rt.device)
        rt.track(
            job.model,
            job.optimizer,
            stateful={"data": job.data},
            generators={"dropout": job.dropout},
        )
        for step in rt.steps():
            with rt.attempt():
                rt.report(loss=job.step(rt.process_group, step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
