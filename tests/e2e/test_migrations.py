"""Migrations through the whole system: client -> planner -> executor -> sidecars.

Each test checks that the job kept training and that its final parameters and
optimizer state are bit-identical to the uninterrupted reference run. A drain and a
failure move machines of two ranks (TP2 x PP2 x DP2); the tests of the control plane's
handling (restarts, two failures at once, stragglers) run with one rank per machine.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import TP1, WAIT_S, next_progress, progress_reaches
from trainmover import bus
from trainmover.client import MachineLeaving, UnknownMachine
from trainmover.localcluster import LocalCluster as Cluster
from trainmover.messages import Command, DrainEvent, MigrationProgress, StragglerEvent

pytestmark = pytest.mark.timeout(900)


async def test_drain_through_the_client(cluster: Cluster, reference) -> None:
    await cluster.wait_step("m1", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    with pytest.raises(UnknownMachine, match="unknown machine 'm9'"):
        await cluster.client.drain(cluster.job, "m9")
    event_id = await cluster.client.drain(cluster.job, "m1", reason="driver update")
    # Once the planner decided, a second drain of the machine on its way out is refused.
    decided = await cluster.wait_state(lambda s: event_id in s.handled, WAIT_S)
    assert decided.machines["m1"].status in ("leaving", "maintenance")
    with pytest.raises(MachineLeaving):
        await cluster.client.drain(cluster.job, "m1", reason="twice")
    done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail
    assert (done.leaver, done.joiner) == ("m1", "s0")
    assert done.downtime_s is not None and "rebuilt 5 groups" in done.detail

    # The planner applies the end of the migration to the cluster state.
    state = await cluster.wait_state(lambda s: s.machines["s0"].status == "active", WAIT_S)
    assert state.machines["s0"].cell == cluster.stack.config.layout.cells()[1]
    assert not state.in_flight
    # The joiner trains on: its steps go past the switch step.
    switch_step = max(cluster.steps.values())
    await cluster.wait_step("s0", switch_step + 5, WAIT_S)

    # The drained machine comes back from maintenance, warm, as a standby.
    back = await cluster.wait_state(lambda s: s.machines["m1"].status == "standby", WAIT_S)
    assert back.machines["m1"].warm_role_types == ["first", "last"]

    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == ["m0", "m2", "m3", "s0"]
    assert cluster.mismatches(await reference(step), step) == []


@pytest.mark.parametrize("config", [TP1])
async def test_services_restarted_mid_migration_complete_it(cluster: Cluster, reference) -> None:
    await cluster.wait_step("m0", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    # The executor dies as phase 1 starts; its successor resumes the record.
    first = await cluster.client.drain(cluster.job, "m0", reason="executor restart")
    await asyncio.wait_for(progress_reaches(cluster, first, "phase1"), WAIT_S)
    await cluster.stack.restart_service("executor")
    done = await cluster.client.wait_for_migration(cluster.job, first, timeout=WAIT_S)
    assert done.state == "done", done.detail

    # The planner dies right after publishing its plan; its successor learns the end of
    # the migration from the durable progress stream.
    second = await cluster.client.drain(cluster.job, "m3", reason="planner restart")
    await asyncio.wait_for(progress_reaches(cluster, second, "planned"), WAIT_S)
    await cluster.stack.restart_service("planner")
    done = await cluster.client.wait_for_migration(cluster.job, second, timeout=WAIT_S)
    assert done.state == "done", done.detail
    state = await cluster.wait_state(
        lambda s: s.machines["s1"].status == "active" and not s.in_flight, WAIT_S
    )
    assert state.machines["s0"].status == "active"
    assert {state.machines[m].status for m in ("m0", "m3")} <= {"maintenance", "standby"}

    # A retried publish of an old event changes nothing.
    retry = DrainEvent(event_id=first, job=cluster.job, machine="m0", reason="retry")
    await cluster.nc.jetstream().publish(f"tm.{cluster.job}.events.drain", retry.to_json())
    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == ["m1", "m2", "s0", "s1"]
    after = await cluster.wait_state(lambda s: s.revision > 0, WAIT_S)
    assert after.machines["s0"].status == "active"
    assert cluster.mismatches(await reference(step), step) == []


async def test_sigkill_of_a_machine_is_recovered_from_its_replica(
    cluster: Cluster, reference
) -> None:
    await cluster.wait_step("m2", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    cluster.stack.kill_machine("m2")  # sidecar and workers, at once
    # The health-monitor notices (heartbeats stop, stayers' collectives fail), the planner
    # picks a warm standby and m2's data-parallel replica m0 as the state source.
    state = await cluster.wait_state(
        lambda s: bool(s.in_flight) or s.machines["m2"].status == "failed", WAIT_S
    )
    (plan,) = [p for p in state.in_flight.values()] or [None]
    assert plan is not None and plan.migration == "unplanned", state
    assert plan.state_sources == {"m2": "m0"}
    done = await cluster.client.wait_for_migration(cluster.job, plan.event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail
    assert done.leaver == "m2" and done.joiner in ("s0", "s1")
    assert done.downtime_s is not None
    after = await cluster.wait_state(lambda s: not s.in_flight, WAIT_S)
    assert after.machines["m2"].status == "failed"
    assert after.machines[done.joiner].status == "active"

    # Training goes on; the failure changed nothing in the result.
    step, _ = await cluster.finish_soon(WAIT_S)
    assert cluster.mismatches(await reference(step), step) == []


@pytest.mark.parametrize("config", [TP1])
async def test_two_machines_killed_at_once_are_recovered_together(
    cluster: Cluster, reference
) -> None:
    await cluster.wait_step("m1", 10, WAIT_S)
    await cluster.wait_standbys_warm(WAIT_S)
    # m0 (dp0, pp0) and m1 (dp0, pp1) share their PP groups: the hard case. Each has a
    # live replica in the other DP replica (m2, m3), and two standbys are warm.
    cluster.stack.kill_machine("m0")
    cluster.stack.kill_machine("m1")
    # Whichever failure the planner hears first, the second supersedes its recovery with
    # one plan that moves both machines.
    state = await cluster.wait_state(
        lambda s: any({"m0", "m1"} <= p.leavers() for p in s.in_flight.values()), WAIT_S
    )
    (plan,) = state.in_flight.values()
    assert plan.migration == "unplanned", plan
    assert plan.state_sources == {"m0": "m2", "m1": "m3"}
    assert {m.joiner for m in plan.moves} == {"s0", "s1"}
    done = await cluster.client.wait_for_migration(cluster.job, plan.event_id, timeout=WAIT_S)
    assert done.state == "done", done.detail
    assert done.moves == {m.leaver: m.joiner for m in plan.moves}
    assert done.downtime_s is not None
    # An earlier failure event whose recovery was superseded ends with the same plan.
    for event_id in plan.merged_events:
        merged = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
        assert (merged.state, merged.plan_id) == ("done", plan.plan_id), merged.detail
    after = await cluster.wait_state(lambda s: not s.in_flight, WAIT_S)
    assert {m: after.machines[m].status for m in ("m0", "m1", "s0", "s1")} == {
        "m0": "failed",
        "m1": "failed",
        "s0": "active",
        "s1": "active",
    }

    # Training goes on; the failures changed nothing in the result.
    step, finished = await cluster.finish_soon(WAIT_S)
    assert finished == ["m2", "m3", "s0", "s1"]
    assert cluster.mismatches(await reference(step), step) == []


# Drained machines stay in maintenance: the pool only shrinks during this test.
@pytest.mark.parametrize("config", [TP1.with_updates(cluster={"maintenance_s": 3600})])
async def test_a_straggler_is_moved_and_a_failure_without_standby_falls_back(
    cluster: Cluster,
) -> None:
    await cluster.wait_step("m3", 20, WAIT_S)
    async with cluster.client.watch(cluster.job) as items:
        reply = await bus.request(
            cluster.nc,
            Command(job=cluster.job, machine="m3", op="slow", args={"extra_s": 0.4}),
        )
        assert reply.ok, reply.error
        for _ in range(3):
            straggler = await asyncio.wait_for(_next_straggler(items), WAIT_S)
            # Only m3 is slow: the others wait for it in collectives, which is not compute.
            assert straggler.machine == "m3"
            assert straggler.evidence.machine_median_s > 1.5 * straggler.evidence.job_median_s
            done = await cluster.client.wait_for_migration(cluster.job, straggler.event_id, WAIT_S)
            if done.state != "rejected":
                break
            # On a loaded host the standbys may still be warming up: the monitor proposes
            # m3 again once one is free, as long as it stays slow.
            assert "no warm standby free" in done.detail, done.detail
    assert done.state == "done" and done.leaver == "m3", done.detail

    # Both standbys taken: a failure now has no warm standby and says it falls back.
    second = await cluster.client.drain(cluster.job, "m0", reason="use the last standby")
    assert (await cluster.client.wait_for_migration(cluster.job, second, WAIT_S)).state == "done"
    failure = await cluster.client.report_failure(cluster.job, "m1", reason="test")
    async with cluster.client.watch(cluster.job, from_start=True) as items:
        fallback = await asyncio.wait_for(next_progress(items, failure, "fallback"), WAIT_S)
    assert "checkpoint restart" in fallback.detail and "no warm standby" in fallback.detail


async def _next_straggler(items) -> StragglerEvent:
    async for item in items:
        if isinstance(item, StragglerEvent):
            return item
    raise AssertionError("watch ended")


@pytest.mark.parametrize("config", [TP1])
async def test_a_leaver_killed_mid_transfer_is_recovered_into_the_same_joiner(
    tmp_path, config, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """m1 is drained and dies after the first chunks of its state went out: the joiner
    applies nothing of it, the drain is aborted, and the recovery of m1 keeps that joiner and
    sends it the state from m1's replica (m3); the job ends bit-identical."""
    monkeypatch.setenv("TM_TEST_FAULT", "m1@*:transfer")
    async with Cluster(config, tmp_path, log_dir=tmp_path / "services") as cluster:
        await cluster.wait_step("m1", 10, WAIT_S)
        await cluster.wait_standbys_warm(WAIT_S)
        drain = await cluster.client.drain(cluster.job, "m1", reason="dies mid-transfer")
        failed = await cluster.client.wait_for_migration(cluster.job, drain, WAIT_S)
        assert failed.state == "aborted" and "from a replica" in failed.detail, failed.detail
        assert failed.joiner is not None
        async with cluster.client.watch(cluster.job, from_start=True) as items:
            done = await asyncio.wait_for(_next_done(items, "m1", other_than=drain), WAIT_S)
        assert done.moves == {"m1": failed.joiner}, done.detail
        logs = "".join(p.read_text() for p in tmp_path.rglob(f"{failed.joiner}-*.log"))
        assert '"event": "transfer_failed"' in logs
        assert '"source": "replica"' in logs  # its recovery took the state from m3
        step, _ = await cluster.finish_soon(WAIT_S)
        assert cluster.mismatches(await reference(step), step) == []


@pytest.mark.parametrize("config", [TP1.with_updates(runtime={"checkpoint_every": 5})])
async def test_a_replica_killed_mid_transfer_falls_back_to_the_checkpoint(
    tmp_path, config, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """m1 is SIGKILLed; its replica m3 dies after the first chunks of the recovery's state
    went out. The joiner applies nothing of it and stays the joiner: one recovery of both
    machines, from the last checkpoint (no replica of their role is left), and the job
    ends bit-identical."""
    monkeypatch.setenv("TM_TEST_FAULT", "m3@*:transfer")
    # Every machine reads every role's checkpoints (a shared file system in production).
    shared = config.with_updates(runtime={"checkpoint_dir": str(tmp_path / "checkpoints")})
    async with Cluster(shared, tmp_path, log_dir=tmp_path / "services") as cluster:
        await cluster.wait_step("m1", 10, WAIT_S)
        await cluster.wait_standbys_warm(WAIT_S)
        cluster.stack.kill_machine("m1")
        state = await cluster.wait_state(
            lambda s: any({"m1", "m3"} <= p.leavers() for p in s.in_flight.values()), WAIT_S
        )
        (plan,) = state.in_flight.values()
        assert plan.migration == "checkpoint_restart", plan
        done = await cluster.client.wait_for_migration(cluster.job, plan.event_id, WAIT_S)
        assert done.state == "done", done.detail
        joiners = set(done.moves.values())
        logs = {m: "".join(p.read_text() for p in tmp_path.rglob(f"{m}-*.log")) for m in joiners}
        (cut,) = [m for m, text in logs.items() if '"event": "recovery_transfer_failed"' in text]
        assert '"source": "checkpoint"' in logs[cut]
        for event_id in plan.merged_events:  # m1's first recovery ends with this plan
            merged = await cluster.client.wait_for_migration(cluster.job, event_id, WAIT_S)
            assert (merged.state, merged.plan_id) == ("done", plan.plan_id), merged.detail
        step, finished = await cluster.finish_soon(WAIT_S)
        assert sorted(finished) == sorted(["m0", "m2", *joiners])
        assert cluster.mismatches(await reference(step), step) == []


async def _next_done(items, leaver: str, other_than: str) -> MigrationProgress:
    async for item in items:
        if (
            isinstance(item, MigrationProgress)
            and item.state == "done"
            and leaver in item.moves
            and item.event_id != other_than
        ):
            return item
    raise AssertionError("watch ended")
