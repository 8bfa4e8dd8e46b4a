"""`trainmover demo`: the main job on the embedded default, for a newcomer.

A TP2 x PP2 x DP2 job on 4 machines of 2 ranks with 2 standby machines trains under the
whole system (embedded nats-server, planner, executor, health-monitor, a sidecar per
machine). While it trains, the demo interrupts it the ways a cluster does:

1. drains a machine through the async client (a planned migration);
2. SIGKILLs every process of another machine (a failure);
3. slows a third machine until the straggler detector moves it.

A drained machine returns to the standby pool once its maintenance is over and it is
warm again. At the end the demo prints a table of the migrations (event, leaver ->
joiner, downtime and its phases, groups rebuilt of the total), runs the same job and
seed without interruptions, and says whether the final parameters and optimizer state
are bit-identical. `--json FILE` writes all of it.

While it runs it shows a live display (trainmover.demoview): steps and step rate,
machines and roles, each migration's phases as they happen. The services' logs go to
files in the run directory (`<workdir>/logs/`, printed at the start); `verbose` streams
them to the terminal instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainmover import bus, demo_examples, logs
from trainmover.demo_examples import REFERENCE, DemoJob
from trainmover.demoview import DemoDisplay
from trainmover.jobview import JobView
from trainmover.localcluster import FAST_SIGNALS, LocalCluster
from trainmover.localjob import LocalJob
from trainmover.messages import TERMINAL_STATES, Command, MigrationProgress, StragglerEvent
from trainmover.runtime.compare import state_files
from trainmover.runtime.config import JobConfig

WAIT_S = 600.0


class DemoFailed(RuntimeError):
    """A scenario could not be played (one line for the person running the demo)."""


STRAGGLER_STEPS = 40
"""Steps a slowed machine needs to be flagged (the detector's window) and moved."""


@dataclass
class MigrationRow:
    kind: str
    event_id: str
    leaver: str | None
    joiner: str | None
    state: str
    downtime_s: float | None
    phases: dict[str, float]
    groups_rebuilt: list[str]
    groups_total: int | None
    detail: str


@dataclass
class DemoReport:
    job: str
    steps: int
    migrations: list[MigrationRow] = field(default_factory=list)
    bitexact: bool | None = None
    mismatches: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def demo_config(steps: int) -> JobConfig:
    return REFERENCE.config(steps)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


async def _follow(cluster: LocalCluster) -> None:
    """Prints every event and migration step as the system publishes it."""
    async with cluster.client.watch(cluster.job, from_start=True) as items:
        async for item in items:
            if isinstance(item, MigrationProgress):
                who = f"{item.leaver} -> {item.joiner}" if item.joiner else (item.leaver or "")
                say(f"  migration {item.state:<12} {who}  {item.detail}")
            else:
                say(f"  event {item.kind} {item.machine} (source {item.source}) {item.reason}")


async def _migration(cluster: LocalCluster, kind: str, event_id: str) -> MigrationRow:
    done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
    return _row(kind, done)


def _row(kind: str, done: MigrationProgress) -> MigrationRow:
    return MigrationRow(
        kind=kind,
        event_id=done.event_id,
        leaver=done.leaver,
        joiner=done.joiner,
        state=done.state,
        downtime_s=done.downtime_s,
        phases=done.phases,
        groups_rebuilt=done.groups_rebuilt,
        groups_total=done.groups_total,
        detail=done.detail,
    )


async def drain(cluster: LocalCluster, machine: str) -> MigrationRow:
    say(f"draining {machine} through the async client (planned migration)")
    event_id = await cluster.client.drain(
        cluster.job, machine, reason="demo: driver update", deadline_s=300
    )
    return await _migration(cluster, "drain", event_id)


async def _warm_standby(cluster: LocalCluster) -> None:
    """Until a standby is free and warm: a move goes to one (on a loaded host the last
    standby may still be warming up when the scenario comes)."""
    await cluster.wait_state(
        lambda s: any(m.status == "standby" and m.warm_role_types for m in s.machines.values()),
        WAIT_S,
    )


async def kill(cluster: LocalCluster, machine: str) -> MigrationRow:
    await _warm_standby(cluster)  # a failure's downtime is its recovery, not a warm-up
    say(f"SIGKILL of every process of {machine} (a failure)")
    before = await cluster.client.status(cluster.job)
    cluster.stack.kill_machine(machine)
    state = await cluster.wait_state(
        lambda s: (
            any(machine in p.leavers() for p in s.in_flight.values())
            or s.revision > before.revision + 50
        ),
        WAIT_S,
    )
    plan = next(p for p in state.in_flight.values() if machine in p.leavers())
    return await _migration(cluster, "failure", plan.event_id)


async def slow_down(cluster: LocalCluster, machine: str, extra_s: float = 0.5) -> MigrationRow:
    """Slows `machine` until the straggler detector flags it and the planner moves it.

    On a loaded host the detector may have flagged it on its own before (its steps were
    slower): that move is the straggler's row, and a machine no longer holding its role
    is not slowed."""
    # A straggler is moved only to a free warm standby (it is slow, not broken): wait for
    # one, e.g. the drained machine back from its maintenance.
    await _warm_standby(cluster)
    left = cluster.config.train.steps - max(cluster.steps.values(), default=0)
    if left < STRAGGLER_STEPS:
        raise DemoFailed(
            f"only {left} training steps left once a standby was warm: too few to detect a "
            "straggler; run the demo with more --steps"
        )
    flagged: set[str] = set()
    slowed = False
    try:
        async with (
            asyncio.timeout(WAIT_S),
            cluster.client.watch(cluster.job, from_start=True) as items,
        ):
            state = await cluster.client.status(cluster.job)
            if state.machines[machine].status == "active":
                await _slow(cluster, machine, extra_s)
                slowed = True
            else:
                say(
                    f"{machine} is {state.machines[machine].status} (flagged on its own): not slowed"
                )
            async for item in items:
                if isinstance(item, StragglerEvent) and item.machine == machine:
                    ev = item.evidence
                    flagged.add(item.event_id)
                    say(
                        f"  the straggler detector flagged {machine}: median step "
                        f"{ev.machine_median_s:.3f} s vs the job's {ev.job_median_s:.3f} s"
                    )
                elif (
                    isinstance(item, MigrationProgress)
                    and item.event_id in flagged
                    and item.state in TERMINAL_STATES
                ):
                    if item.state == "done":
                        return _row("straggler", item)
                    say(f"  its move ended {item.state} ({item.detail}): not moved yet")
                    if not slowed:
                        await _slow(cluster, machine, extra_s)
                        slowed = True
    except TimeoutError:
        raise DemoFailed(
            f"{machine} was not moved as a straggler within {WAIT_S:.0f} s "
            f"(flagged: {len(flagged)} times)"
        ) from None
    raise RuntimeError("the event stream ended")


async def _slow(cluster: LocalCluster, machine: str, extra_s: float) -> None:
    say(f"slowing {machine} by {extra_s} s of compute per step (a straggler)")
    reply = await bus.request(
        cluster.nc, Command(job=cluster.job, machine=machine, op="slow", args={"extra_s": extra_s})
    )
    if not reply.ok:
        raise DemoFailed(f"could not slow {machine}: {reply.error}")


Scenario = Callable[[LocalCluster], Awaitable[MigrationRow]]


async def run(
    steps: int,
    workdir: Path,
    scenarios: list[Scenario],
    job: DemoJob = REFERENCE,
    verbose: bool = False,
) -> DemoReport:
    config = job.config(steps)
    if config.runtime.checkpoint_every and not config.runtime.checkpoint_dir:
        # Every machine reads every role's checkpoints: a shared file system's stand-in.
        config = config.with_updates(runtime={"checkpoint_dir": str(workdir / "checkpoints")})
    report = DemoReport(job=config.job, steps=steps)
    t0 = time.monotonic()
    say(f"starting the local cluster: {job.description} (workdir {workdir})")
    log_dir = None if verbose else workdir / "logs"
    if log_dir is not None:
        say(f"services' logs: {log_dir}/ (worker logs: {workdir}/cluster/run/*/logs/)")
    service_args = {**FAST_SIGNALS, "sidecar": FAST_SIGNALS["sidecar"] + job.sidecar_args()}
    async with LocalCluster(config, workdir / "cluster", service_args, log_dir=log_dir) as cluster:
        async with JobView(cluster.nc, cluster.job, total_steps=steps) as view:
            await cluster.wait_step("m0", 10, WAIT_S)
            say("training (step 10 reached)")
            async with contextlib.AsyncExitStack() as shown:
                if verbose:
                    follower = asyncio.create_task(_follow(cluster))
                    shown.callback(follower.cancel)
                else:
                    await shown.enter_async_context(DemoDisplay(view))
                for scenario in scenarios:
                    report.migrations.append(await scenario(cluster))
                # Nothing is left to show: the job ends a few steps on (at most `steps`).
                last, _ = await cluster.finish_soon(WAIT_S)
                say(f"training ended after step {last}")
    report.steps = last
    # The cluster is down first: its standbys (a drained machine back from maintenance
    # warms up) would only slow the comparison run on a small host.
    say("running the same job and seed without interruptions, for comparison")
    reference_dir = workdir / "reference"
    with LocalJob.launch(
        job.config(last), reference_dir, standbys=0, timeout_s=WAIT_S, entry=job.entry
    ) as uninterrupted:
        uninterrupted.finish(WAIT_S)
    report.mismatches = cluster.mismatches(state_files(reference_dir, last), last)
    report.bitexact = not report.mismatches
    report.wall_s = time.monotonic() - t0
    return report


def table(report: DemoReport) -> str:
    lines = [
        f"{'event':<11}{'leaver -> joiner':<18}{'state':<8}{'downtime':>10}  "
        f"{'groups rebuilt':<16}phases (s)",
    ]
    for m in report.migrations:
        down = f"{m.downtime_s:.3f} s" if m.downtime_s is not None else "-"
        groups = f"{len(m.groups_rebuilt)} of {m.groups_total}" if m.groups_total else "-"
        phases = ", ".join(f"{k} {v:.3f}" for k, v in m.phases.items() if k != "downtime")
        lines.append(
            f"{m.kind:<11}{f'{m.leaver} -> {m.joiner}':<18}{m.state:<8}{down:>10}  "
            f"{groups:<16}{phases}"
        )
    verdict = "bit-identical" if report.bitexact else f"DIFFERENT ({len(report.mismatches)})"
    lines.append(f"final parameters and optimizer state vs uninterrupted run: {verdict}")
    return "\n".join(lines)


def main(
    json_path: str | None,
    steps: int | None,
    workdir: str | None,
    example: str | None = None,
    verbose: bool = False,
) -> int:
    """Runs the demo; exit 0 when every migration is done and the result bit-identical."""
    job = demo_examples.pick(example)
    steps = steps or job.default_steps
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="trainmover-demo-"))
    if not verbose:
        # This process's own logs (the stack, the bus client) go with the services'.
        (root / "logs").mkdir(parents=True, exist_ok=True)
        logs.configure("json", stream=open(root / "logs" / "demo.log", "a"))  # noqa: SIM115
    scenarios = demo_examples.scenarios(job, drain, kill, slow_down)
    try:
        report = asyncio.run(run(steps, root, scenarios, job, verbose))
    except DemoFailed as err:
        print(f"trainmover demo: error: {err} (logs: {root / 'logs'})", file=sys.stderr)
        return 1
    print()
    print(table(report))
    for line in report.mismatches[:10]:
        print(f"  {line}", file=sys.stderr)
    if json_path:
        Path(json_path).write_text(json.dumps(asdict(report), indent=2))
        say(f"wrote {json_path}")
    ok = report.bitexact and all(m.state == "done" for m in report.migrations)
    return 0 if ok else 1
