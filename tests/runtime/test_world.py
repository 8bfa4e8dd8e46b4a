"""The default (world) group of a TP/PP layout between real processes (`world_entry.py`).

A PP2 x DP2 job (4 machines, one rank each) all-reduces its gradients over the world
group every step. Two runs of the same job and seed: an uninterrupted one, and one where
a warm standby takes over m0 in a planned migration (m3 shares no group with m0: the
plan never reaches it, yet its world group contained m0), then m3 is SIGKILLed mid-step
and a second standby takes over from its DP replica. Both dump every role's state at
the last step; they must be bit-identical, and every rank's log says at which (epoch,
step) it built a world group. A third job that never touches the world group is
migrated too: no rank of it builds one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples.test_ddp import CONFIG as DDP_CONFIG
from tests.examples.test_ddp import Run, assert_bit_identical
from trainmover.localjob import LocalJob

from .conftest import worker_events

ENTRY = "tests.runtime.world_entry"
STEPS = 10
WAIT_S = 300.0
# The DDP example's job (its timeouts), at PP2 x DP2.
CONFIG = DDP_CONFIG.with_updates(
    job="world-test",
    layout={"pp": 2},
    cluster={"machines": ["m0", "m1", "m2", "m3"]},
    train={"steps": STEPS, "dump_steps": [STEPS]},
)
ROLES = ["d0p0t0", "d0p1t0", "d1p0t0", "d1p1t0"]
PLANNED_AT = 3
FAULT = ("m3", 6, "after-allreduce")  # the world all-reduces of step 6 done, before its vote


def world_events(run_dir: Path, event: str = "world_built") -> dict[str, list[str]]:
    """machine -> the world groups its rank built (or dropped), in order (from its log)."""
    found: dict[str, list[str]] = {}
    for log in sorted((run_dir / "logs").glob("*-0.log")):
        machine = log.name.removesuffix("-0.log")
        for entry in worker_events(log, event):
            found.setdefault(machine, []).append(entry["group"])
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("world-reference")
    with LocalJob.launch(CONFIG, run_dir, standbys=0, entry=ENTRY, timeout_s=WAIT_S) as job:
        job.finish(timeout_s=WAIT_S)
        return Run(run_dir, job.losses(), steps=STEPS)


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("world-moved")
    # m2 rebuilds its pipeline group with the failure's joiner (s1), whose code waits.
    env = {"TM_TEST_FAULT": "{}@{}:{}".format(*FAULT), "TM_TEST_HOLD": "s1:m2"}
    with LocalJob.launch(
        CONFIG, run_dir, standbys=2, entry=ENTRY, timeout_s=WAIT_S, limit=2, extra_env=env
    ) as job:
        job.wait_step(2)
        warmed = job.warm(timeout_s=WAIT_S)  # world collectives answered in the sandbox
        job.set_limit(PLANNED_AT)
        report = job.migrate({"m0": "s0"}, at_step=PLANNED_AT)
        assert report.commit_step == PLANNED_AT
        assert "m3" not in report.plan.affected_machines()  # the plan never reaches m3
        job.set_limit(STEPS)
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        assert dead == FAULT[0]
        recovery = job.recover(dead, detected_at=noticed, timeout_s=WAIT_S)
        assert recovery.step == FAULT[1] - 1
        # The planner's recovery: the first free standby, the state from the replica.
        assert [(m.leaver, m.joiner) for m in recovery.plan.moves] == [(dead, "s1")]
        assert (
            recovery.plan.migration == "unplanned" and job.state.machines[dead].status == "failed"
        )
        job.finish(timeout_s=WAIT_S)
        return Run(run_dir, job.losses(), warmed, [recovery], steps=STEPS)


def test_world_all_reduces_stay_bit_identical_across_a_move_and_a_failure(reference, moved):
    assert_bit_identical(moved, reference, ROLES)


def test_a_failure_joiner_builds_its_groups_while_its_code_builds_the_role(moved):
    # s1's code built nothing until m2 had recovered, and m2 rebuilt its pipeline group
    # with s1: that group was built while s1's code waited.
    assert (moved.run_dir / "held-s1").read_text() == "m2"
    (m2,) = [e for ref, e in moved.recoveries[0].switched.items() if ref.machine == "m2"]
    assert "pp.d1.t0" in m2.rebuilt


def test_the_world_group_is_built_at_first_use_and_after_each_switch_on_every_rank(
    reference, moved
):
    # Before step 1 (the initial broadcast) on every rank; no switch, no other build.
    assert world_events(reference.run_dir) == {m: ["world.e0.1"] for m in ("m0", "m1", "m2", "m3")}
    recovery = moved.recoveries[0].plan.plan_id  # a recovery's epoch is its plan
    after_move, after_failure = f"world.e0.{PLANNED_AT + 1}", f"world.{recovery}.{FAULT[1]}"
    assert world_events(moved.run_dir) == {
        "m0": ["world.e0.1"],  # the leaver
        "m1": ["world.e0.1", after_move, after_failure],
        "m2": ["world.e0.1", after_move, after_failure],
        "m3": ["world.e0.1", after_move],  # untouched by the plan, killed in step 6
        "s0": [after_move, after_failure],  # the planned joiner
        "s1": [after_failure],  # the failure's joiner
    }
    # Each switch drops the old group on the ranks it reaches, and builds nothing.
    dropped = world_events(moved.run_dir, "world_dropped")
    assert dropped == {
        "m1": ["world.e0.1", after_move],
        "m2": ["world.e0.1", after_move],
        "s0": [after_move],  # at the recovery
    }


def test_the_standbys_answered_world_collectives_inside_the_sandbox(moved):
    assert moved.warmed is not None and len(moved.warmed) == 2
    for warmed in moved.warmed.values():
        assert warmed.error == "" and not warmed.store_known
        # per iteration and role type: a gradient and a probe all-reduce per parameter
        assert warmed.synthesized >= 2 * 3 * len(warmed.role_types)


def test_a_migration_of_a_job_that_never_uses_the_world_group_builds_none(
    tmp_path: Path,
) -> None:
    config = CONFIG.with_updates(
        layout={"dp": 1}, cluster={"machines": ["m0", "m1"]}, train={"steps": 4}
    )
    env = {"TM_TEST_WORLD": "0"}
    with LocalJob.launch(
        config, tmp_path, standbys=1, entry=ENTRY, timeout_s=WAIT_S, limit=2, extra_env=env
    ) as job:
        report = job.migrate({"m1": "s0"}, at_step=2)
        job.finish(timeout_s=WAIT_S)
    assert {r.machine for r in report.switched} == {"m0", "m1", "s0"}
    assert world_events(tmp_path) == {}
