"""The reference job: a 3D-parallel GPT-style decoder trained under TrainMover.

Run by the launcher as ``python -m trainmover.runtime.reference`` in every worker
process (active or standby). It is also the example of the integration surface: apart
from building its model, the loop only calls `Runtime` a handful of times.
"""

from __future__ import annotations

import sys

import torch

from trainmover.runtime.data import TokenStream
from trainmover.runtime.model import StageModel
from trainmover.runtime.train_step import train_step
from trainmover.runtime.worker import Runtime


def warm_up() -> None:
    """What a standby can do before it has a role: the first Adam construction imports
    torch._dynamo (~1.5 s), which would otherwise land on the migration's critical path."""
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


def main() -> int:
    with Runtime.from_env() as rt:
        cfg = rt.config
        warm_up()
        role = rt.wait_for_role()
        if role is None:
            return 0  # a standby released without being used
        torch.manual_seed(cfg.train.seed)
        # Shared by the TP ranks of a machine (same masks on replicated activations),
        # distinct per pipeline stage and replica.
        dropout = torch.Generator(device=rt.device).manual_seed(
            cfg.train.seed * 1_000 + role.dp * cfg.layout.pp + role.pp
        )
        model = StageModel(
            cfg.model, cfg.layout, role, cfg.train.seed, lambda: rt.groups["tp"], dropout
        ).to(rt.device)
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
        rt.track(model, optimizer, stateful={"data": data}, generators={"dropout": dropout})
        for _step in rt.steps():
            loss = train_step(
                model,
                optimizer,
                data.next_batch(),
                rt.groups,
                cfg.train.micro_batches,
                cfg.model.d_model,
            )
            rt.report(loss=loss)
    return 0


if __name__ == "__main__":
    sys.exit(main())
