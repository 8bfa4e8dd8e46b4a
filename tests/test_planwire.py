"""A plan in a command: the same plan comes out, a twelfth of the bytes at 2,048
machines, decoded once for the commands that carry it, and bad input refused by name."""

from __future__ import annotations

import base64
import time
import zlib

import pytest

from trainmover.messages import (
    MAX_MESSAGE_BYTES,
    Command,
    DrainEvent,
    MachineState,
    MessageError,
    Plan,
)
from trainmover.planwire import PLAN_ARG, plan_args, plan_of
from trainmover.runtime.config import ClusterConfig, JobConfig, ModelConfig
from trainmover.runtime.layout import Layout
from trainmover.services.planner.cluster import initial_state
from trainmover.services.planner.decisions import Planner


def drain_plan(layout: Layout, job: str = "wire") -> Plan:
    machines = [f"m-{i:05d}" for i in range(layout.machines)]
    config = JobConfig(
        job=job,
        layout=layout,
        model=ModelConfig(n_heads=8, d_model=64, n_layers=layout.pp),
        cluster=ClusterConfig(machines=machines, standbys=["s-0"]),
    )
    state = initial_state(config)
    warm = MachineState(status="standby", warm_role_types=list(layout.role_types()))
    state = state.model_copy(update={"machines": {**state.machines, "s-0": warm}})
    planner = Planner(members=frozenset([*machines, "s-0"]))
    outcome = planner.on_event(state, DrainEvent(job=job, machine=machines[3]), time.time())
    return outcome.plans[0]


def command(args: dict[str, object]) -> Command:
    return Command(command_id="p1.prepare.m-1", job="wire", machine="m-1", op="prepare", args=args)


def test_a_plan_comes_out_as_it_went_in_and_is_decoded_once_for_its_commands() -> None:
    plan = drain_plan(Layout(tp=2, pp=2, dp=4))
    args = plan_args(plan)
    first, again = plan_of(command(dict(args))), plan_of(command(dict(args)))
    assert first == plan
    assert again is first


def test_the_plan_of_a_2048_machine_drain_travels_in_a_twelfth_of_its_json() -> None:
    plan = drain_plan(Layout(tp=8, pp=8, dp=256), job="big")
    text = plan_args(plan)[PLAN_ARG]
    assert len(text) * 8 < len(plan.model_dump_json())
    assert plan_of(command({PLAN_ARG: text})) == plan


def test_a_command_without_its_plan_names_what_it_needs() -> None:
    with pytest.raises(ValueError, match=r"prepare p1\.prepare\.m-1: needs args\.plan_zlib"):
        plan_of(command({"plan": "{}"}))


@pytest.mark.parametrize("text", ["not base64!", base64.b64encode(b"not zlib").decode()])
def test_a_plan_that_is_not_zlib_in_base64_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match=r"args\.plan_zlib is not zlib in base64"):
        plan_of(command({PLAN_ARG: text}))


def test_a_small_text_that_inflates_past_the_message_limit_is_refused_by_its_size() -> None:
    bomb = base64.b64encode(zlib.compress(b" " * (4 * MAX_MESSAGE_BYTES), 9)).decode()
    assert len(bomb) < 16_000
    with pytest.raises(MessageError, match="exceeds the limit"):
        plan_of(command({PLAN_ARG: bomb}))
