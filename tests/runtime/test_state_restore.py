"""Restoring a role's state into FSDP2 (DTensor) parameters and optimizer state, in one
process: a one-rank mesh, so every shard is the whole tensor and a step needs no peer.

A joiner primed before its state arrives writes it straight into the storage of its own
shards; one that was not goes through the checkpoint API's loaders. Both continue
bit-identically to the run they took over."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainmover.runtime import state as state_module
from trainmover.runtime.state import TrainingState


@pytest.fixture
def mesh() -> Iterator[object]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


class Counter:
    """A stateful helper (a data position)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def build(mesh: object, init_seed: int) -> TrainingState:
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return TrainingState(model, optimizer, {"data": Counter()})


def train(state: TrainingState, steps: int) -> None:
    for _ in range(steps):
        data = state.stateful["data"]
        gen = torch.Generator().manual_seed(100 + data.position)
        x = torch.randn(4, 6, generator=gen)
        state.optimizer.zero_grad()
        state.model(x).pow(2).sum().backward()
        state.optimizer.step()
        data.position += 1
        state.step += 1


def captured(state: TrainingState) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """What a leaver sends: its header, and copies of its tensors (a received state)."""
    return state.header(), {n: t.clone() for n, t in state.named_tensors().items()}


def assert_same(ours: TrainingState, theirs: TrainingState) -> None:
    mine, other = ours.named_tensors(), theirs.named_tensors()
    assert mine.keys() == other.keys()
    for name in mine:
        assert torch.equal(mine[name], other[name]), name
    assert ours.step == theirs.step


def loaders_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint API's loader ran")

    monkeypatch.setattr(state_module, "set_model_state_dict", refused)
    monkeypatch.setattr(state_module, "set_optimizer_state_dict", refused)


def test_a_primed_joiner_writes_the_state_into_its_own_shards(mesh, monkeypatch):
    leaver, reference, joiner = build(mesh, 1), build(mesh, 1), build(mesh, 2)
    train(leaver, 3)
    train(reference, 3)
    joiner.prime()
    storage = {n: t.data_ptr() for n, t in joiner.named_tensors().items() if n[:4] != "rng."}
    header, tensors = captured(leaver)
    loaders_refused(monkeypatch)
    joiner.restore(header, tensors)
    assert {n: t.data_ptr() for n, t in joiner.named_tensors().items() if n in storage} == storage
    assert joiner.stateful["data"].position == 3
    assert_same(joiner, leaver)
    train(joiner, 2)
    train(reference, 2)
    assert_same(joiner, reference)


def test_a_joiner_not_primed_restores_through_the_checkpoint_api(mesh, monkeypatch):
    leaver, reference, joiner = build(mesh, 1), build(mesh, 1), build(mesh, 2)
    train(leaver, 3)
    train(reference, 3)
    header, tensors = captured(leaver)
    used: list[str] = []
    real = state_module.set_optimizer_state_dict

    def spied(*args: object, **kwargs: object) -> None:
        used.append("optimizer")
        real(*args, **kwargs)

    monkeypatch.setattr(state_module, "set_optimizer_state_dict", spied)
    joiner.restore(header, tensors)
    assert used == ["optimizer"]
    train(joiner, 2)
    train(reference, 2)
    assert_same(joiner, reference)


def test_a_changed_learning_rate_travels_with_the_state(mesh, monkeypatch):
    leaver, joiner = build(mesh, 1), build(mesh, 2)
    train(leaver, 2)
    leaver.optimizer.param_groups[0]["lr"] = 0.125
    joiner.prime()
    loaders_refused(monkeypatch)
    joiner.restore(*captured(leaver))
    assert joiner.optimizer.param_groups[0]["lr"] == 0.125
    assert joiner.optimizer.param_groups[0]["betas"] == leaver.optimizer.param_groups[0]["betas"]
    assert isinstance(joiner.optimizer.param_groups[0]["betas"], tuple)


def test_priming_gives_state_only_to_an_optimizer_that_never_stepped(mesh):
    fresh = build(mesh, 1)
    before = {n: t.clone() for n, t in fresh.named_tensors().items() if n.startswith("model.")}
    fresh.prime()
    after = fresh.named_tensors()
    assert any(n.startswith("optim.") for n in after)
    for name, value in before.items():  # a step of learning rate zero moves nothing
        assert torch.equal(after[name], value), name
    trained = build(mesh, 1)
    train(trained, 2)
    kept = {n: t.clone() for n, t in trained.named_tensors().items()}
    trained.prime()
    for name, value in trained.named_tensors().items():
        assert torch.equal(value, kept[name]), name
