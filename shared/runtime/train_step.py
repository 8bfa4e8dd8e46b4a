"""One training step of the reference job: a GPipe pipeline schedule over the PP group,
gradient all-reduce over the DP group, then Adam. Every collective is a standard
`torch.distributed` call on the role's c10d groups (`rt.process_group(kind)`).

GPipe keeps the schedule easy to check: all micro-batches forward (activations sent to
the next stage), then all backward in reverse order (input gradients sent to the previous
stage). Sends are posted without waiting and waited at the end of the step, so a stage
never blocks on its own send while its peer blocks on another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainmover.runtime import fault
from trainmover.runtime.model import StageModel

#: The role's c10d group of a kind ("tp", "pp", "dp"): `rt.process_group`.
GroupsOf = Callable[[str], dist.ProcessGroup]


def allreduce_gradients(model: torch.nn.Module, dp: dist.ProcessGroup) -> None:
    """Averages gradients over the DP replicas in one flat all-reduce."""
    if dp.size() == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp)
    flat /= dp.size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def pipeline_step(
    model: StageModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batches: int,
    pp: dist.ProcessGroup,
    d_model: int,
) -> float | None:
    """Forward and backward of one step's micro-batches; returns the mean loss on the last
    stage, None elsewhere. Gradients are left in the parameters."""
    stage, last = pp.rank(), pp.rank() == pp.size() - 1
    device = next(model.parameters()).device
    xs, ys = inputs.to(device).chunk(micro_batches), targets.to(device).chunk(micro_batches)
    pending: list[tuple[dist.Work, torch.Tensor]] = []  # (work, tensor alive until waited)
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    total = 0.0

    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if stage == 0:
            inp = None
            out = model(x)
        else:
            inp = torch.empty(x.shape[0], x.shape[1], d_model, device=device)
            dist.recv(inp, group_src=stage - 1, group=pp, tag=i)
            inp.requires_grad_(True)
            out = model(inp)
        if last:
            out = F.cross_entropy(out.flatten(0, 1), y.flatten()) / micro_batches
            total += out.item()
        else:
            act = out.detach().contiguous()
            pending.append((_isend(act, stage + 1, pp, tag=i), act))
        saved.append((inp, out))
        fault.point("forward")  # test-only: a machine dies mid forward

    for i in reversed(range(micro_batches)):
        inp, out = saved[i]
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, group_src=stage + 1, group=pp, tag=micro_batches + i)
            out.backward(grad)
        fault.point("backward")  # test-only: a machine dies mid backward
        if inp is not None and inp.grad is not None:
            g = inp.grad.contiguous()
            pending.append((_isend(g, stage - 1, pp, tag=micro_batches + i), g))

    for work, _ in pending:
        work.wait()
    return total if last else None


def _isend(tensor: torch.Tensor, peer: int, pp: dist.ProcessGroup, tag: int) -> dist.Work:
    work = dist.isend(tensor, group_dst=peer, group=pp, tag=tag)
    assert work is not None  # None only for a rank outside the group
    return work


def train_step(
    model: StageModel,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    group: GroupsOf,
    micro_batches: int,
    d_model: int,
) -> float | None:
    """A full step: pipeline forward/backward, DP gradient average, optimizer update."""
    optimizer.zero_grad(set_to_none=True)
    loss = pipeline_step(model, *batch, micro_batches, group("pp"), d_model)
    allreduce_gradients(model, group("dp"))
    optimizer.step()
    return loss
