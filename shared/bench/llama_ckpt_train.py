"""The checkpoint-restart baseline of examples/llama: the example's torchrun script as a
user runs it today, with the distributed checkpoint a torchtitan user adds to survive a
restart.

    torchrun --nnodes N --nproc-per-node TP --max-restarts R ... \\
        -m trainmover.bench.llama_ckpt_train --config job.json --run-dir DIR --every N

It trains with the very code of `trainmover.examples.llama.train` (`build`, `train_step`,
the mesh from `init_device_mesh` over torchrun's process group) at the settings the
TrainMover version reads from the same job config, so both systems train the same job.
Every `--every` steps the ranks save the sharded model and optimizer state together with
`torch.distributed.checkpoint` (each rank writes its own shards; the state dicts come
from `torch.distributed.checkpoint.state_dict`), then each rank its data position and
RNG state in a file of its own; a restarted job resumes from the newest step every rank
finished. Command line, stop file and events are `trainmover.bench.ckpt_train`'s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainmover.bench.ckpt_train import (
    begin,
    latest_complete,
    rank_events,
    save_rank_file,
    step_folder,
    train_with_checkpoints,
)
from trainmover.examples.llama.train import (
    Trainer,
    build,
    device_for,
    dp_coordinates,
    train_step,
)
from trainmover.examples.llama.train_trainmover import settings_from_job


def role_key(mesh: DeviceMesh) -> str:
    """This rank's role as the benchmarks name it (d<DP index>p<stage>t<TP rank>); rank 0
    is d0p0t0, the role the harness's SIGKILL aims at."""
    names = mesh.mesh_dim_names or ()
    dp, _ = dp_coordinates(mesh)
    pp = mesh.get_local_rank("pp") if "pp" in names else 0
    tp = mesh.get_local_rank("tp") if "tp" in names else 0
    return f"d{dp}p{pp}t{tp}"


class _Sharded(Stateful):
    """The model's and optimizer's sharded state as DCP saves and loads it (the
    documented recipe: DCP calls `load_state_dict` once it has read the shards, which
    restores the optimizer's parameter groups too, not only its tensors)."""

    def __init__(self, t: Trainer):
        self.t = t

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.t.model, self.t.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.t.model,
            self.t.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        # A pipeline stage's flattened parameter groups can come back without their
        # hyperparameters (pytorch/pytorch#143828): the script never changes them, so
        # the optimizer's own defaults are the saved values.
        for group in self.t.optimizer.param_groups:
            for key, value in self.t.optimizer.defaults.items():
                group.setdefault(key, value)


def save(t: Trainer, folder: Path, rank: int, step: int) -> None:
    """Every rank's shards in one distributed checkpoint (a collective), then this rank's
    own file, last: the checkpoint counts once every rank's file is there."""
    dcp.save({"app": _Sharded(t)}, checkpoint_id=folder)
    own = {"step": step, "data": t.data.state_dict(), "rng": torch.get_rng_state()}
    save_rank_file(own, folder, rank)


def load(t: Trainer, folder: Path, rank: int) -> int:
    """The checkpoint in `folder` restored into `t`; its step."""
    dcp.load({"app": _Sharded(t)}, checkpoint_id=folder)
    own = torch.load(folder / f"rank{rank}.pt", weights_only=False)
    t.data.load_state_dict(own["data"])
    torch.set_rng_state(own["rng"])
    return int(own["step"])


def main(argv: list[str] | None = None) -> int:
    args, cfg = begin(argv, __doc__.splitlines()[0])
    s = settings_from_job(cfg)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for(int(os.environ.get("LOCAL_RANK", "0")))
    shape = s.mesh_shape()
    mesh = init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    events = rank_events(args, rank, role_key(mesh))
    t = build(s, mesh, device)
    ckpt_dir = args.run_dir / "ckpt"
    resume = latest_complete(ckpt_dir, world)
    step = load(t, ckpt_dir / f"step{resume}", rank) if resume else 0
    events.write("loaded", step=step)
    try:
        train_with_checkpoints(
            args,
            events,
            step,
            lambda: train_step(t, s),
            lambda at: save(t, step_folder(ckpt_dir, at), rank, at),
        )
    finally:
        dist.destroy_process_group()  # a gloo group alive at exit can abort the process
    events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
