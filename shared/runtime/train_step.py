"""One training step of the reference job: a GPipe pipeline schedule over the PP group,
gradient all-reduce over the DP group, then Adam.

GPipe keeps the schedule easy to check: all micro-batches forward (activations sent to
the next stage), then all backward in reverse order (input gradients sent to the previous
stage). Sends are posted without waiting and waited at the end of the step, so a stage
never blocks on its own send while its peer blocks on another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainmover.runtime import fault
from trainmover.runtime.groups import Group, GroupTable, PendingWork
from trainmover.runtime.model import StageModel


def allreduce_gradients(model: torch.nn.Module, dp: Group) -> None:
    """Averages gradients over the DP replicas in one flat all-reduce."""
    if dp.size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dp.allreduce(flat)
    flat /= dp.size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def pipeline_step(
    model: StageModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batches: int,
    pp: Group,
    d_model: int,
) -> float | None:
    """Forward and backward of one step's micro-batches; returns the mean loss on the last
    stage, None elsewhere. Gradients are left in the parameters."""
    stage, last = pp.rank, pp.rank == pp.size - 1
    device = next(model.parameters()).device
    xs, ys = inputs.to(device).chunk(micro_batches), targets.to(device).chunk(micro_batches)
    pending: list[tuple[PendingWork, torch.Tensor]] = []  # (work, tensor alive until waited)
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    total = 0.0

    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if stage == 0:
            inp = None
            out = model(x)
        else:
            inp = torch.empty(x.shape[0], x.shape[1], d_model, device=device)
            pp.recv(inp, stage - 1, tag=i)
            inp.requires_grad_(True)
            out = model(inp)
        if last:
            out = F.cross_entropy(out.flatten(0, 1), y.flatten()) / micro_batches
            total += out.item()
        else:
            act = out.detach().contiguous()
            pending.append((pp.send(act, stage + 1, tag=i), act))
        saved.append((inp, out))
        fault.point("forward")  # test-only: a machine dies mid forward

    for i in reversed(range(micro_batches)):
        inp, out = saved[i]
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            pp.recv(grad, stage + 1, tag=micro_batches + i)
            out.backward(grad)
        fault.point("backward")  # test-only: a machine dies mid backward
        if inp is not None and inp.grad is not None:
            g = inp.grad.contiguous()
            pending.append((pp.send(g, stage - 1, tag=micro_batches + i), g))

    for work, _ in pending:
        work.wait()
    return total if last else None


def train_step(
    model: StageModel,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    groups: GroupTable,
    micro_batches: int,
    d_model: int,
) -> float | None:
    """A full step: pipeline forward/backward, DP gradient average, optimizer update."""
    optimizer.zero_grad(set_to_none=True)
    loss = pipeline_step(model, *batch, micro_batches, groups["pp"], d_model)
    allreduce_gradients(model, groups["dp"])
    optimizer.step()
    return loss
