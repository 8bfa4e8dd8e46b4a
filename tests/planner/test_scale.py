"""Planning at the scale of a large job: the groups of a layout are enumerated once each
(building every group from each of its ranks made one plan of 512 machines take a second,
of 2,048 machines tens of seconds), and the result is the same groups as before."""

from __future__ import annotations

import time

import pytest

from trainmover.messages import DrainEvent, FailureEvent, Heartbeat, MachineState, WorkerStatus
from trainmover.runtime.config import ClusterConfig, JobConfig, ModelConfig
from trainmover.runtime.layout import Layout
from trainmover.services.planner.cluster import initial_state
from trainmover.services.planner.decisions import Planner
from trainmover.services.planner.service import admit_all

LAYOUTS = [
    Layout(tp=2, pp=2, dp=4),
    Layout(tp=1, pp=3, dp=2),
    Layout(tp=2, pp=1, dp=8, dp_shard=2),  # HSDP: dp_shard and dp_replicate groups
    Layout(tp=2, pp=2, dp=4, dp_shard=4),  # pure FSDP
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.label)
def test_every_group_once_as_asked_of_each_rank(layout: Layout) -> None:
    brute = {
        layout.group_name(kind, role): (kind, layout.group_members(kind, role))
        for cell in layout.cells()
        for role in layout.roles_of(cell)
        for kind in layout.role_group_kinds
    }
    assert layout.all_groups() == dict(sorted(brute.items()))
    assert layout.group_names() == sorted(brute)
    for name, group in brute.items():
        assert layout.group(name) == group
        assert layout.has_group(name)


@pytest.mark.parametrize("name", ["tp.d9.p0", "tp.d01.p0", "xx.d0.p0", "tp.dx.p0", "tp", ""])
def test_a_name_of_no_group_is_no_group(name: str) -> None:
    assert not Layout(tp=2, pp=2, dp=4).has_group(name)


def test_a_plan_of_a_2048_machine_job_takes_a_fraction_of_a_second() -> None:
    """The bound is a wide margin over ~50 ms (a loaded runner); the quadratic
    enumeration took tens of seconds here."""
    layout = Layout(tp=8, pp=8, dp=256)
    machines = [f"m{i}" for i in range(layout.machines)]
    standbys = [f"s{i}" for i in range(20)]
    config = JobConfig(
        job="big",
        layout=layout,
        model=ModelConfig(n_heads=8, d_model=64, n_layers=8),
        cluster=ClusterConfig(machines=machines, standbys=standbys),
    )
    state = initial_state(config)
    warm = MachineState(status="standby", warm_role_types=list(layout.role_types()))
    state = state.model_copy(
        update={"machines": {**state.machines, **dict.fromkeys(standbys, warm)}}
    )
    planner = Planner(members=frozenset([*machines, *standbys]))
    started = time.process_time()
    drained = planner.on_event(state, DrainEvent(job="big", machine="m5"), time.time())
    failed = planner.on_event(
        state, FailureEvent(job="big", machine="m9", reason="gone", source="heartbeat"), time.time()
    )
    assert time.process_time() - started < 5.0
    assert [p.migration for p in drained.plans + failed.plans] == ["planned", "unplanned"]
    # The delta of one machine: its TP group, and the PP and DP groups of its 8 ranks.
    assert len(drained.plans[0].groups) == 1 + 8 + 8


def test_heartbeats_decided_together_admit_as_each_alone() -> None:
    """The service decides the heartbeats that came while it wrote in one decision
    (`admit_all`): each machine's first heartbeat of a 2,048-machine start took a state
    write of its own, and the heartbeat subscription fell behind until the bus dropped
    its messages."""
    layout = Layout(tp=8, pp=8, dp=32)
    machines = [f"m{i}" for i in range(layout.machines)]
    config = JobConfig(
        job="big",
        layout=layout,
        model=ModelConfig(n_heads=8, d_model=64, n_layers=8),
        cluster=ClusterConfig(machines=machines, standbys=["s0", "s1"]),
    )
    planner = Planner(members=frozenset([*machines, "s0", "s1"]))
    beats = [
        Heartbeat(job="big", machine=m, seq=1, status="active", instance=f"i-{m}") for m in machines
    ] + [
        Heartbeat(
            job="big", machine=s, seq=1, status="standby", instance=f"i-{s}",
            workers=[WorkerStatus(local_rank=t, state="standby") for t in range(8)],
            warm_role_types=list(layout.role_types()),
        )
        for s in ("s0", "s1")
    ]  # fmt: skip
    state = initial_state(config)
    together = admit_all(planner, state, beats, 1.0).state
    alone = state
    for beat in beats:
        alone = planner.on_heartbeat(alone, beat, 1.0).state
    assert together == alone
    assert all(together.machines[m].instance == f"i-{m}" for m in machines)
    assert {together.machines[s].status for s in ("s0", "s1")} == {"standby"}
