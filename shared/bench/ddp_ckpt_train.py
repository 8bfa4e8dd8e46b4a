"""The checkpoint-restart baseline of examples/ddp: the example's torchrun script as a
user runs it today, with the periodic checkpoint such a script adds to survive a restart.

    torchrun --nnodes N --nproc-per-node 1 --max-restarts R ... \\
        -m trainmover.bench.ddp_ckpt_train --config job.json --run-dir DIR --every N

It trains with the very code of `trainmover.examples.ddp.train` (`build`, `train_step`,
plain `dist.init_process_group()` from torchrun's environment) at the settings the
TrainMover version reads from the same job config, so both systems train the same job.
Every `--every` steps each rank saves its model, AdamW state (through
`torch.distributed.checkpoint.state_dict`), data position and RNG state; a restarted
rank resumes from the newest step every rank saved. Command line, stop file and events
are `trainmover.bench.ckpt_train`'s (the harness is `ckpt_restart.TorchrunJob`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainmover.bench.ckpt_train import (
    begin,
    latest_complete,
    rank_events,
    save_rank_file,
    step_folder,
    train_with_checkpoints,
)
from trainmover.examples.ddp.train import build, device_for, train_step
from trainmover.examples.ddp.train_trainmover import settings_from_job


def _state(model: Any, optimizer: torch.optim.Optimizer, data: Any, step: int) -> dict:
    return {
        "step": step,
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
        "data": data.state_dict(),
        "rng": torch.get_rng_state(),
    }


def main(argv: list[str] | None = None) -> int:
    args, cfg = begin(argv, __doc__.splitlines()[0])
    s = settings_from_job(cfg)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    events = rank_events(args, rank, f"d{rank}p0t0")
    model, optimizer, data = build(s, device_for(int(os.environ.get("LOCAL_RANK", "0"))))
    step = 0
    ckpt_dir = args.run_dir / "ckpt"
    resume = latest_complete(ckpt_dir, world)
    if resume:
        saved = torch.load(ckpt_dir / f"step{resume}" / f"rank{rank}.pt", weights_only=False)
        set_model_state_dict(model, saved["model"])
        set_optimizer_state_dict(model, optimizer, saved["optim"])
        data.load_state_dict(saved["data"])
        torch.set_rng_state(saved["rng"])
        step = saved["step"]
    events.write("loaded", step=step)

    def train_one() -> float:
        return train_step(model, optimizer, data, s)

    def save(step: int) -> None:
        save_rank_file(_state(model, optimizer, data, step), step_folder(ckpt_dir, step), rank)

    try:
        train_with_checkpoints(args, events, step, train_one, save)
    finally:
        dist.destroy_process_group()  # a gloo group alive at exit can abort the process
    events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
