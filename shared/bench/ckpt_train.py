"""The checkpoint-restart baseline's training script: the reference job's role, run by
``torchrun`` (torch.distributed.elastic) the way users run jobs today.

    torchrun --nnodes N --nproc-per-node TP --max-restarts R ... \\
        -m trainmover.bench.ckpt_train --config job.json --run-dir DIR --every N

Each worker takes its role from RANK (machines are TP-sized blocks of ranks, numbered as
the reference job numbers them), builds its TP/PP/DP groups with the runtime's group
builder from torchrun's store, resumes from the newest complete checkpoint, checkpoints
every `--every` steps, and stops (after a checkpoint: save-and-restart) at the step
written in DIR/stop_at. Events (start, loaded, step, saved) go to DIR/events/.

Restarted workers must never read the dead workers' addresses from a store
(pytorch/pytorch#135712: "Gloo connectFullMesh ... Connection refused"). The harness sets
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so rank 0 hosts a fresh store for every round. A
key prefix from TORCHELASTIC_RESTART_COUNT would not do with several agents: only the agent
whose worker died counts the restart, so the others would wait under another prefix.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainmover.bench.role import EventWriter, build_role
from trainmover.runtime.build import build_group
from trainmover.runtime.config import JobConfig, load_config
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Role
from trainmover.runtime.pgs import ProcessGroups
from trainmover.runtime.plan import RankRef, group_specs
from trainmover.runtime.state import load_saved


def latest_complete(ckpt_dir: Path, world: int) -> int:
    """The newest step for which every rank's checkpoint file exists (0: none)."""
    steps = [
        int(d.name.removeprefix("step"))
        for d in ckpt_dir.glob("step*")
        if len(list(d.glob("*.pt"))) == world
    ]
    return max(steps, default=0)


def stop_step(run_dir: Path) -> int | None:
    try:
        return int((run_dir / "stop_at").read_text())
    except (FileNotFoundError, ValueError):
        return None


def _store(timeout_s: float) -> dist.Store:
    """torchrun's store: the agent's shared rendezvous store (a client), or, with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, one hosted by rank 0."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=not shared and os.environ["RANK"] == "0",
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def arguments(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The command line every checkpoint-restart training script takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--every", type=int, required=True, help="checkpoint every N steps")
    parser.add_argument("--launch", default="0", help="distinguishes relaunches in the store")
    return parser.parse_args(argv)


def begin(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, JobConfig]:
    """A checkpoint-restart script's command line and job config (torch's threads set
    as the job config says, as under TrainMover)."""
    args = arguments(argv, description)
    cfg = load_config(args.config)
    torch.set_num_threads(cfg.runtime.threads)
    return args, cfg


def rank_events(args: argparse.Namespace, rank: int, role: str) -> EventWriter:
    """This worker's event file (one per launch, torchrun restart and rank), its start
    written."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = EventWriter(
        args.run_dir / "events" / f"l{args.launch}-r{restart}-rank{rank}.jsonl",
        rank=rank,
        role=role,
        restart=restart,
        launch=args.launch,
    )
    events.write("start")
    return events


def main(argv: list[str] | None = None) -> int:
    args, cfg = begin(argv, __doc__.splitlines()[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    layout = cfg.layout
    machine, tp = divmod(rank, layout.tp)
    cells = layout.cells()
    cell = cells[machine]
    role = Role(dp=cell.dp, pp=cell.pp, tp=tp)
    events = rank_events(args, rank, role.key)

    timeout = cfg.runtime.group_timeout_s
    store = _store(timeout)
    me = RankRef(machine=f"m{machine}", local_rank=tp)
    assignment = {f"m{i}": c for i, c in enumerate(cells)}
    specs = [
        s
        for s in group_specs(layout, assignment, dict.fromkeys(layout.all_groups(), 0))
        if s.group_rank(me) is not None
    ]
    groups = GroupTable()
    namespace = f"{cfg.job}/launch{args.launch}"
    device = torch.device("cpu")
    groups.install([build_group(s, me, store, namespace, device, timeout) for s in specs])
    c10d = ProcessGroups(layout, role, groups.get, dist.HashStore())
    r = build_role(cfg, role, lambda: c10d.get("tp"), device)

    ckpt_dir = args.run_dir / "ckpt"
    resume = latest_complete(ckpt_dir, world)
    if resume:
        saved = load_saved(ckpt_dir / f"step{resume}" / f"{role.key}.pt")
        r.state.restore(saved["header"], saved["tensors"])
    events.write("loaded", step=r.state.step)

    def train_one() -> float | None:
        loss = r.job.step(c10d.get, r.state.step + 1)
        r.state.step += 1
        return loss

    def save(step: int) -> None:
        r.state.save(step_folder(ckpt_dir, step) / f"{role.key}.pt")

    try:
        train_with_checkpoints(args, events, r.state.step, train_one, save)
    finally:
        c10d.close()
        groups.shutdown()  # a gloo group alive at exit can abort the process
    events.close()
    return 0


def step_folder(ckpt_dir: Path, step: int) -> Path:
    """Where every rank's checkpoint of `step` goes (made if missing)."""
    folder = ckpt_dir / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_rank_file(state: dict[str, Any], folder: Path, rank: int) -> None:
    """This rank's file of a checkpoint (atomic: written under another name, then
    renamed, so `latest_complete` never counts a half-written one)."""
    tmp = folder / f"rank{rank}.tmp"
    torch.save(state, tmp)
    tmp.rename(folder / f"rank{rank}.pt")


def train_with_checkpoints(
    args: argparse.Namespace,
    events: EventWriter,
    step: int,
    train_one: Callable[[], float | None],
    save: Callable[[int], None],
) -> None:
    """The loop of every checkpoint-restart script: `train_one` step after `step`, a
    checkpoint (`save(step)`) every `args.every` steps, and at the stop step (written in
    run_dir/stop_at) a last checkpoint before returning (save-and-restart)."""
    saved = step  # what the job resumed from is on disk already
    while True:
        stop = stop_step(args.run_dir)
        if stop is not None and step >= stop:
            if saved != step:
                save(step)
                events.write("saved", step=step)
            return
        loss = train_one()
        step += 1
        events.write("step", step=step, loss=loss)
        if step % args.every == 0:
            save(step)
            events.write("saved", step=step)
            saved = step


if __name__ == "__main__":
    sys.exit(main())
