"""One rank of `test_world.py`: a torchrun-style loop over the default (world) group of a
TP/PP layout, launched by `LocalJob` (``entry="tests.runtime.world_entry"``).

Every step averages the gradients over the world group with `dist.all_reduce` (so the
DP replicas of a stage, which start equal, stay equal: a failure's joiner restored from
one continues exactly) and checks a second all-reduce against its known sum. The loop
syncs the initial parameters with a world broadcast before training, as torchrun
scripts do. With ``TM_TEST_WORLD=0`` it never touches the world group. With
``TM_TEST_HOLD=<joiner>:<stayer>`` the joiner's code, once it has its role, builds
nothing until the stayer has logged its recovery (`hold`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Role
from trainmover.runtime.worker import Runtime


def build(role: Role, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1000 + role.pp)  # the DP replicas of a stage start equal
    model = torch.nn.Linear(8, 8).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    role: Role,
    step: int,
    world: bool,
    check: bool,
) -> float:
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(step * 1000 + role.dp * 10 + role.pp)
    optimizer.zero_grad()
    loss = model(torch.randn(4, 8, generator=gen).to(device)).square().mean()
    loss.backward()
    if world:
        size = dist.get_world_size()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(size)
        probe = torch.tensor([dist.get_rank() + 1.0], device=device)
        dist.all_reduce(probe)
        if check and probe.item() != size * (size + 1) / 2:
            raise RuntimeError(f"world all_reduce of step {step} returned {probe.item()}")
    optimizer.step()
    return loss.item()


def hold(machine: str) -> None:
    """A failure's stayer that rebuilds a group with this joiner can log its recovery only
    once the joiner's side of that group is built: held here, the joiner's code shows
    that its groups build while it builds its role, not after. Leaves `held-<machine>`
    in the run directory."""
    joiner, _, stayer = os.environ.get("TM_TEST_HOLD", "").partition(":")
    if joiner != machine:
        return
    run_dir = Path(os.environ["TM_RUN_DIR"])
    log = run_dir / "logs" / f"{stayer}-0.log"
    deadline = time.monotonic() + 120.0
    while not (log.exists() and '"event": "recovered"' in log.read_text()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stayer} did not recover while {machine}'s code waited")
        time.sleep(0.05)  # a log file tells no one when it grows
    (run_dir / f"held-{machine}").write_text(stayer)


def main() -> int:
    world = os.environ.get("TM_TEST_WORLD", "1") == "1"
    with Runtime.from_env() as rt:

        def shadow(role: Role, groups: GroupTable) -> Callable[[], float]:
            model, optimizer = build(role, rt.device)
            # Inside the sandbox every member "holds my values": no known sum to check.
            return lambda: train_step(model, optimizer, role, 1, world, check=False)

        role = rt.wait_for_role(shadow=shadow)
        if role is None:
            return 0
        hold(rt.me.machine)
        dist.init_process_group()
        model, optimizer = build(role, rt.device)
        if world:
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
        rt.track(model, optimizer)
        for step in rt.steps():
            with rt.attempt():
                rt.report(loss=train_step(model, optimizer, role, step, world, check=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
