"""Heartbeats, worker exits, collective errors and step statistics -> events, with the
monitor running in-process against the real nats-server."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NatsClient

from tests.conftest import register_job, sample_state
from tests.integration.programs import poll
from trainmover.messages import (
    CollectiveErrorReport,
    FailureEvent,
    Heartbeat,
    MachineState,
    StallReport,
    StepStats,
    StragglerEvent,
    WorkerStatus,
)
from trainmover.subjects import JobSubjects
from trainmover.tasks import cancel_and_wait

from .conftest import (
    MonitorFactory,
    dead_letters_of,
    events_of,
    is_event,
    metrics,
)

ALL = {"m0", "m1", "m2", "m3", "s0"}


async def test_missed_heartbeats_yield_exactly_one_failure_event(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    await register_job(nc, job)
    events = await events_of(nc, job)
    beats = heartbeats(ALL)
    hm = await monitor()
    await beats.beat_once()

    beats.alive.discard("m1")  # m1's sidecar stops heartbeating
    first = await events.wait_for(is_event("m1", source="heartbeat"))
    assert isinstance(first, FailureEvent) and "missed heartbeats" in first.reason

    # Sentinel: a standby dies later; its event comes after any repeat m1 could produce.
    beats.alive.discard("s0")
    await events.wait_for(is_event("s0", source="heartbeat"))
    assert [(e.machine, e.kind) for e in events.items] == [("m1", "failure"), ("s0", "failure")]

    scraped = await metrics(hm.port)
    assert (
        scraped[f'trainmover_health_events_total{{job="{job}",kind="failure",source="heartbeat"}}']
        == 2
    )
    assert scraped[f'trainmover_health_machines_up{{job="{job}"}}'] == 3
    assert scraped['trainmover_health_detection_latency_seconds_count{source="heartbeat"}'] == 2


async def test_a_joiner_that_goes_silent_is_reported(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    state = sample_state(job)
    joining = MachineState(status="joining", warm_role_types=["first", "last"])
    state = state.model_copy(update={"machines": {**state.machines, "s0": joining}})
    await register_job(nc, job, state)
    events = await events_of(nc, job)
    beats = heartbeats(ALL)
    await monitor()
    await beats.beat_once()
    beats.alive.discard("s0")  # killed in phase 1 of the migration it joins
    event = await events.wait_for(is_event("s0", source="heartbeat"))
    assert isinstance(event, FailureEvent) and "missed heartbeats" in event.reason


async def test_abnormal_worker_exit_yields_failure_event(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    await register_job(nc, job)
    events = await events_of(nc, job)
    beats = heartbeats(ALL)
    hm = await monitor()
    await beats.beat_once()

    beats.workers["m2"] = [
        WorkerStatus(local_rank=0, pid=100, state="running"),
        WorkerStatus(local_rank=1, pid=101, state="exited", exit_code=-9),
    ]
    # A clean exit (code 0, a leaver's workers after the switch) is not a failure.
    beats.workers["m0"] = [WorkerStatus(local_rank=0, pid=7, state="exited", exit_code=0)]
    exit_event = await events.wait_for(is_event("m2", source="worker_exit"))
    assert isinstance(exit_event, FailureEvent) and exit_event.exit_code == -9
    assert "local rank 1 (code -9)" in exit_event.reason

    # Sentinel on the same subscription: m3's worker exits after m2 has repeated its exit.
    beats.workers["m3"] = [WorkerStatus(local_rank=0, pid=9, state="exited", exit_code=1)]
    await events.wait_for(is_event("m3", source="worker_exit"))
    assert [e.machine for e in events.items] == ["m2", "m3"]
    scraped = await metrics(hm.port)
    assert (
        scraped[
            f'trainmover_health_duplicates_total{{job="{job}",kind="failure",source="worker_exit"}}'
        ]
        >= 1
    )


async def test_collective_error_names_the_peer_and_unknown_machines_are_dead_lettered(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    await register_job(nc, job)
    events = await events_of(nc, job)
    letters = await dead_letters_of(nc, job)
    heartbeats(ALL)
    await monitor()
    subjects = JobSubjects(job)

    ghost = Heartbeat(job=job, machine="ghost", seq=1, status="active")
    await nc.publish(subjects.heartbeat("ghost"), ghost.to_json())
    letter = await letters.wait_for(lambda d: "ghost" in d.reason)
    assert "unknown machine 'ghost'" in letter.reason and letter.service == "health-monitor"

    await nc.publish(subjects.heartbeat("m0"), b"{not json")
    await letters.wait_for(lambda d: "malformed JSON" in d.reason)

    # m0 (dp0, pp0) shares no group with m3 (dp1, pp1): it cannot blame it.
    forged = CollectiveErrorReport(
        job=job, machine="m0", peer="m3", group="dp.p1.t0", error="Connection closed by peer"
    )
    await nc.publish(subjects.collective_error("m0"), forged.to_json())
    letter = await letters.wait_for(lambda d: "cannot blame m3" in d.reason)
    assert "m0 not in group 'dp.p1.t0'" in letter.reason, letter.reason
    nowhere = forged.model_copy(update={"machine": "m1", "group": "dp0"})
    await nc.publish(subjects.collective_error("m1"), nowhere.to_json())
    await letters.wait_for(lambda d: "has no group 'dp0'" in d.reason)

    # Two stayers that share a group with m3 blame it: one event.
    for reporter, group in (("m1", "dp.p1.t0"), ("m2", "pp.d1.t0")):
        report = CollectiveErrorReport(
            job=job, machine=reporter, peer="m3", group=group, error="Connection closed by peer"
        )
        await nc.publish(subjects.collective_error(reporter), report.to_json())
    event = await events.wait_for(is_event("m3", source="collective_error"))
    assert "reported by m1" in event.reason and "dp.p1.t0" in event.reason

    ghost_report = CollectiveErrorReport(
        job=job, machine="m0", peer="nobody", group="tp", error="x"
    )
    await nc.publish(subjects.collective_error("m0"), ghost_report.to_json())
    await letters.wait_for(lambda d: "unknown machine 'nobody'" in d.reason)
    assert [e.machine for e in events.items] == ["m3"]


async def test_a_silent_machine_starved_of_a_cpu_is_excused_and_a_stopped_one_is_not(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    state = sample_state(job)
    await register_job(nc, job, state)
    events = await events_of(nc, job)
    beats = heartbeats(ALL)

    def workers(runnable: int) -> list[WorkerStatus]:
        # Constant CPU time between heartbeats: starved when runnable, stopped when not.
        return [
            WorkerStatus(local_rank=r, pid=100 + r, state="running", cpu_s=4.0, cpu_wait_s=1.0,
                         runnable_threads=runnable)
            for r in (0, 1)
        ]  # fmt: skip

    beats.workers.update(m1=workers(1), m2=workers(0), m3=workers(1))
    grace = 0.5
    hm = await monitor("--starved-grace", str(grace))

    def evidence_in() -> bool | None:
        now = time.monotonic()
        return all(hm.signals.cpu.starved(job, m, [0], now) for m in ("m1", "m3")) or None

    await poll(evidence_in, "two heartbeats of m1 and m3 taken in")
    ranks = {
        m: sorted(
            state.layout.global_rank(r) for r in state.layout.roles_of(state.machines[m].cell)
        )
        for m in ("m1", "m2", "m3")
    }

    async def stall(culprit: str, silent: bool) -> None:
        # Each by a machine sharing a group with the culprit (m0 shares none with m3).
        reporter = "m1" if culprit == "m3" else "m0"
        report = StallReport(
            job=job, machine=reporter, epoch="e0", step=40, culprits={culprit: ranks[culprit]},
            silent=[culprit] if silent else [], reason="no progress", waited_s=1.5,
            median_step_s=0.1,
        )  # fmt: skip
        await nc.publish(JobSubjects(job).stall(reporter), report.to_json())

    for culprit, silent in (("m1", True), ("m2", True), ("m3", False)):
        await stall(culprit, silent)
    # m1 is excused; m2 (stopped) and m3 (starved, but its ranks beat: it computes) are not.
    await events.wait_count(2)
    # The monitor takes the reports in order: it excused m1 before it decided on m2 and
    # m3, so its grace for m1 started before now.
    excused_at = time.monotonic()
    assert sorted(e.machine for e in events.items) == ["m2", "m3"]
    assert all(isinstance(e, FailureEvent) and e.source == "no_progress" for e in events.items)
    scraped = await metrics(hm.port)
    assert scraped[f'trainmover_health_stalls_excused_total{{job="{job}"}}'] == 1

    # Still silent and starved in the same step once the grace is over: believed.
    await asyncio.sleep(max(0.0, excused_at + grace - time.monotonic()))  # the grace
    await stall("m1", True)
    event = await events.wait_for(is_event("m1", source="no_progress"))
    assert "starved of a CPU" in event.reason and "past the grace" in event.reason


async def test_straggler_needs_sustained_slowness(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    await register_job(nc, job)
    events = await events_of(nc, job)
    heartbeats(ALL)
    await monitor("--straggler-steps", "4", "--straggler-window", "8", "--straggler-factor", "1.5")
    subjects = JobSubjects(job)

    async def step(n: int, times: dict[str, float]) -> None:
        for machine, t in times.items():
            stats = StepStats(job=job, machine=machine, step=n, compute_s=t)
            await nc.publish(subjects.stats(machine), stats.to_json())

    normal = {"m0": 0.10, "m1": 0.11, "m2": 0.10, "m3": 0.12}
    for n in range(10):
        await step(n, normal)
    await step(10, {**normal, "m2": 0.5})  # one slow step: noise
    for n in range(11, 20):
        await step(n, normal)
    for n in range(20, 40):  # m2 stays slow: a straggler, reported once
        await step(n, {**normal, "m2": 0.3})
    found = await events.wait_for(is_event("m2", kind="straggler"))
    assert isinstance(found, StragglerEvent) and found.source == "straggler_detector"
    assert found.evidence.window == 4 and found.evidence.factor == 1.5
    assert found.evidence.machine_median_s == 0.3
    assert 0.1 <= found.evidence.job_median_s <= 0.12
    assert "above 1.5 x the job median" in found.reason

    # Sentinel: m1 becomes slow too; by its event, every m2 step above was processed.
    for n in range(40, 50):
        await step(n, {**normal, "m2": 0.3, "m1": 0.4})
    await events.wait_for(is_event("m1", kind="straggler"))
    assert [(e.machine, e.kind) for e in events.items] == [
        ("m2", "straggler"),
        ("m1", "straggler"),
    ]


async def test_a_straggler_the_planner_rejected_is_proposed_again_while_still_slow(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    state = sample_state(job, standbys=1)  # s0: a warm standby, free
    await register_job(nc, job, state)
    events = await events_of(nc, job)
    heartbeats(ALL)
    await monitor(
        "--straggler-steps",
        "4",
        "--straggler-window",
        "8",
        "--straggler-factor",
        "1.5",
        "--straggler-retry",
        "0.01",
    )
    subjects = JobSubjects(job)
    normal = {"m0": 0.10, "m1": 0.11, "m2": 0.10, "m3": 0.12}
    steps = iter(range(10_000))

    async def step(times: dict[str, float]) -> None:
        n = next(steps)
        for machine, t in times.items():
            stats = StepStats(job=job, machine=machine, step=n, compute_s=t)
            await nc.publish(subjects.stats(machine), stats.to_json())

    for _ in range(10):
        await step(normal)
    for _ in range(20):
        await step({**normal, "m2": 0.3})
    first = await events.wait_for(is_event("m2", kind="straggler"))
    # Undecided by the planner: m2 stays slow, a standby is free, still one question.
    for _ in range(10):
        await step({**normal, "m2": 0.3})
    for _ in range(10):  # sentinel on the same subscription: m1 slow too
        await step({**normal, "m2": 0.3, "m1": 0.4})
    await events.wait_for(is_event("m1", kind="straggler"))
    assert [e.machine for e in events.items] == ["m2", "m1"]

    # The planner turned m2 down (in its state, as it records decisions); the standby is
    # free and m2 still slow: it is proposed again, as a new event.
    kv = await nc.jetstream().key_value(subjects.bucket)
    decided = state.model_copy(update={"handled": {first.event_id: "rejected"}, "revision": 1})
    await kv.put("cluster", decided.to_json())

    async def stay_slow() -> None:
        while True:
            await step({**normal, "m2": 0.3, "m1": 0.4})
            await asyncio.sleep(0.02)

    publisher = asyncio.create_task(stay_slow())
    try:
        again = await events.wait_for(lambda e: is_event("m2", "straggler")(e) and e is not first)
    finally:
        await cancel_and_wait([publisher], owner="test publisher")
    assert isinstance(again, StragglerEvent) and again.event_id != first.event_id
    assert again.evidence.machine_median_s == 0.3
    assert again.source == "straggler_detector"


async def test_restart_keeps_incidents_and_waits_for_heartbeats(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    await register_job(nc, job)
    events = await events_of(nc, job)
    beats = heartbeats(ALL - {"m1"})
    first = await monitor("--startup-grace", "2")
    await events.wait_for(is_event("m1"))  # m1 never heartbeats
    await first.stop()

    # A restarted monitor: the m1 incident comes back from the health bucket, and the
    # live machines get their grace period instead of being declared dead. (The grace is
    # shorter than the timeout here so that m1's repeat lapse comes before s0's.)
    second = await monitor("--startup-grace", "0.5")
    scraped = await metrics(second.port)
    assert scraped["trainmover_health_open_incidents"] == 1

    beats.alive.discard("s0")  # sentinel: a failure that happens after the restart
    await events.wait_for(is_event("s0"))
    assert [e.machine for e in events.items] == ["m1", "s0"]
    scraped = await metrics(second.port)
    assert (
        scraped[
            f'trainmover_health_duplicates_total{{job="{job}",kind="failure",source="heartbeat"}}'
        ]
        == 1
    )


async def test_planner_settling_a_machine_closes_its_incident(
    nc: NatsClient, job: str, monitor: MonitorFactory, heartbeats
) -> None:
    from trainmover.messages import MachineState

    state = sample_state(job)
    await register_job(nc, job, state)
    events = await events_of(nc, job)
    beats = heartbeats(ALL)
    hm = await monitor()
    beats.alive.discard("m3")
    await events.wait_for(is_event("m3"))

    # The planner marks m3 failed, then re-admits it as a standby after repair.
    kv = await nc.jetstream().key_value(JobSubjects(job).bucket)
    failed = {**state.machines, "m3": MachineState(status="failed")}
    await kv.put("cluster", state.model_copy(update={"machines": failed, "revision": 1}).to_json())
    readmitted = {**state.machines, "m3": MachineState(status="standby")}
    await kv.put(
        "cluster", state.model_copy(update={"machines": readmitted, "revision": 2}).to_json()
    )
    # Never heard again after re-admission: a new incident, a new event.
    second = await events.wait_for(lambda e: e.machine == "m3" and e is not events.items[0])
    assert second.event_id != events.items[0].event_id
    assert "grace" in second.reason
    assert hm.roster.status(job, "m3") == "standby"
