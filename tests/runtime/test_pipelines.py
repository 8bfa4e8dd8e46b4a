"""The runtime's view of pipeline schedules, in one process: a one-stage pipeline over a
one-rank group (every stage alone, so a step needs no peer)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from trainmover.runtime import pipelines

CPU = torch.device("cpu")


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pipelines.install()
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        pipelines.remove()
        dist.destroy_process_group()


def _schedule(group: dist.ProcessGroup, cls=Schedule1F1B, **stage_args):
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh())
    stage = PipelineStage(model, 0, 1, CPU, group=group, **stage_args)
    return cls(stage, 2, loss_fn=lambda out, target: (out - target).pow(2).mean())


def _step(schedule) -> None:
    losses: list[torch.Tensor] = []
    schedule.step(torch.ones(4, 4), target=torch.zeros(4, 6), losses=losses)
    assert len(losses) == 2


def test_every_schedule_built_is_known_and_a_restart_redoes_the_handshake(group):
    one, other = _schedule(group), _schedule(group, ScheduleGPipe)
    assert set(pipelines.schedules()) == {one, other}
    _step(one)
    assert one._stage_forward_initialized and one._stage_backward_initialized
    one._internal_losses.append(torch.ones(()))  # a step cut short left a loss behind
    assert pipelines.restart(pinned=False) == 2
    assert not one._stage_forward_initialized and one._internal_losses == []
    _step(one)  # the handshake again, and the loss count is right
    del other
    gc.collect()
    assert pipelines.schedules() == [one]  # a dropped schedule is forgotten


def test_a_pinned_restart_keeps_the_settled_shapes_and_a_recovery_gives_back_the_users(group):
    schedule = _schedule(group)
    stage = schedule._stage
    assert not stage._user_meta.is_complete_for_forward()  # inferred at the first step
    _step(schedule)
    described = json.loads(pipelines.describe())
    assert described == [
        {
            "stage": 0,
            "inputs": [
                {"shape": [2, 4], "stride": [4, 1], "dtype": "float32", "requires_grad": False}
            ],
            "outputs": [
                {"shape": [2, 6], "stride": [6, 1], "dtype": "float32", "requires_grad": True}
            ],
        }
    ]
    pipelines.restart(pinned=True)
    assert stage._user_meta.inputs[0].shape == torch.Size([2, 4])
    _step(schedule)  # static now: no inference
    pipelines.restart(pinned=False)
    assert not stage._user_meta.is_complete_for_forward()


def test_a_joiner_takes_the_leavers_shapes_and_a_shadow_borrows_recorded_ones(group):
    leaver = _schedule(group)
    _step(leaver)
    shapes = pipelines.describe()
    joiner = _schedule(group)
    pipelines.restart(pinned=True, lent=shapes)
    assert joiner._stage._user_meta.outputs[0].shape == torch.Size([2, 6])
    with pipelines.lending(shapes):
        shadow = _schedule(group)
    after = _schedule(group)
    assert shadow._stage._user_meta.is_complete_for_forward()
    assert not after._stage._user_meta.is_complete_for_forward()


def test_shapes_the_user_gave_are_never_replaced(group):
    given = _schedule(
        group, input_args=torch.empty(2, 4), output_args=torch.empty(2, 6, requires_grad=True)
    )
    wrong = json.dumps(
        [
            {
                "stage": 0,
                "inputs": [{"shape": [9], "stride": [1], "dtype": "float32", "requires_grad": 0}],
                "outputs": [{"shape": [9], "stride": [1], "dtype": "float32", "requires_grad": 1}],
            }
        ]
    )
    pipelines.restart(pinned=True, lent=wrong)
    assert given._stage._user_meta.inputs[0].shape == torch.Size([2, 4])
    _step(given)
