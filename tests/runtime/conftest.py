"""Shared real-process runs of the reference job (TP2 x PP2 x DP2, 4 machines x 2 ranks).

Process start-up dominates on these machines (~5 s of CPU per worker), so each run is
started once per session and inspected by several tests:

- `reference_run`: the uninterrupted job, 100 steps, no standby.
- `migrated_run`: the same job and seed with four standby machines and three planned
  migrations in a row, each committed at a chosen step: the first-stage machine of
  replica 0, then the last-stage machine of replica 1, then two machines at once (the
  remaining ones: last stage of replica 0, first stage of replica 1), whose stayers are
  the earlier joiners.

- `failure_run` (issue 5): the same job with four standbys; four machines are SIGKILLed
  mid-step one after the other (test-only fault hook: forward, backward, during the
  gradient all-reduce, right after it) and each is recovered from its DP replica.
- `checkpoint_run` (issue 5): TP2 x PP2 x DP1 with periodic checkpoints; a machine is
  killed mid-step and every rank falls back to the last common checkpoint.

The standbys of `migrated_run` run shadow iterations before they join, so its
bit-identical checks also prove that warm-up leaves no trace.

The runs dump every role's full state after the steps in `DUMP_STEPS` (each a few steps
after a switch), so a broken migration shows at the first dump after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainmover.localjob import LocalJob
from trainmover.runtime import control as c
from trainmover.runtime.config import JobConfig
from trainmover.runtime.plan import Plan, RankRef
from trainmover.runtime.reports import RecoveryReport


@dataclass(frozen=True)
class Scenario:
    name: str
    moves: dict[str, str]
    #: Training is held at `prepare_at` while phase 1 starts, and at `switch_at` for the
    #: commit: both steps are then exact, whatever the machine's speed.
    prepare_at: int
    switch_at: int
    #: The first dump after the switch.
    check_at: int
    #: Stayers get the plan before the joiner (see `migrate_staggered`); otherwise the
    #: driver's own `LocalJob.migrate(moves, at_step=switch_at)` runs it.
    staggered: bool = True


SCENARIOS = [
    Scenario("first stage, replica 0", {"m0": "s0"}, 4, 10, 14),
    Scenario("last stage, replica 1", {"m3": "s1"}, 10, 18, 22),
    Scenario("two machines at once", {"m1": "s2", "m2": "s3"}, 18, 26, 40, staggered=False),
]
DUMP_STEPS = [s.check_at for s in SCENARIOS]
MIGRATED_STEPS = 40
#: Generous bound on any one wait: the 2 shared cores are sometimes heavily loaded by
#: other jobs, and ~10 workers importing torch at once then take minutes.
WAIT_S = 400.0

CONFIG = JobConfig(job="runtime-test").with_updates(
    train={"steps": 100, "dump_steps": DUMP_STEPS},
    runtime={"group_timeout_s": 60, "failure_timeout_s": 60, "report_digest": True},
)

#: The smallest job with a DP replica: two machines of one rank (1 x 1 x 2).
DP2 = CONFIG.with_updates(layout={"tp": 1, "pp": 1, "dp": 2}, cluster={"machines": ["m0", "m1"]})

#: (machine, step, point) of each SIGKILL in `failure_run`, in order. Each later victim's
#: replica is an earlier joiner, so recovery is also exercised from recovered machines.
FAULTS = [
    ("m0", 6, "forward"),
    ("m3", 12, "backward"),
    ("m1", 18, "dp-allreduce"),
    ("m2", 24, "after-allreduce"),
]
CHECKPOINT_FAULT = ("m1", 11, "backward")
#: The step a job with faults is held at until every worker, standbys included, said
#: hello: on a loaded host a standby can take longer to start than the job takes to
#: reach its first fault, and the harness's start-up then sees a worker die.
HELD_AT = 1
CHECKPOINT_EVERY = 4


@dataclass
class Migration:
    scenario: Scenario
    plan: Plan
    before: dict[RankRef, c.RankStatus]
    after: dict[RankRef, c.RankStatus]
    ready: dict[RankRef, c.Ready]
    switched: dict[RankRef, c.Switched]


@dataclass
class Run:
    run_dir: Path
    losses: dict[int, float]
    migrations: list[Migration] = field(default_factory=list)
    warmed: dict[RankRef, c.Warmed] = field(default_factory=dict)
    recoveries: list[RecoveryReport] = field(default_factory=list)
    aborted: dict[RankRef, list[c.StepAbortedEvent]] = field(default_factory=dict)
    collective_errors: list[tuple[RankRef, c.CollectiveErrorEvent]] = field(default_factory=list)
    history: list[tuple[RankRef, c.StepDone]] = field(default_factory=list)
    final: dict[RankRef, c.RankStatus] = field(default_factory=dict)

    def state_file(self, role_key: str, step: int) -> Path:
        return self.run_dir / "state" / f"{role_key}.step{step}.pt"


def worker_events(log: Path, event: str) -> list[dict]:
    """The structured entries named `event` in a worker's log file. The file also holds
    what native code writes to the worker's stderr (c10d's warnings), which is not JSON."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("event") == event:
            found.append(entry)
    return found


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("reference")
    with LocalJob.launch(CONFIG, run_dir, standbys=0, timeout_s=WAIT_S) as job:
        job.finish()
        return Run(run_dir, job.losses())


def migrate_staggered(job: LocalJob, scenario: Scenario) -> tuple[Plan, dict, dict]:
    """Phase 1 with a provable overlap: the stayers get the plan first and the joiner and
    leaver only once the stayers completed two more steps. Every delta group contains a
    joiner rank, so the stayers' phase 1 is still running while they train those steps.
    The commit is sent while the job is held at the switch step, so it is exact."""
    plan = job.make_plan(scenario.moves)
    job.prepare(plan, machines=plan.stayers())
    job.set_limit(scenario.switch_at)
    job.wait_step(scenario.prepare_at + 2, machines=plan.stayers())
    job.prepare(plan, machines=plan.leavers() | plan.joiners())
    ready = job.wait_ready(plan)
    job.wait_step(scenario.switch_at)
    job.commit(plan, scenario.switch_at)
    return plan, ready, job.wait_switched(plan)


def migrate(job: LocalJob, scenario: Scenario) -> Migration:
    job.wait_step(scenario.prepare_at)
    before = job.status()
    if scenario.staggered:
        plan, ready, switched = migrate_staggered(job, scenario)
    else:
        report = job.migrate(scenario.moves, at_step=scenario.switch_at)
        plan, ready, switched = report.plan, report.ready, report.switched
    return Migration(scenario, plan, before, job.status(), ready, switched)


@pytest.fixture(scope="session")
def migrated_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("migrated")
    config = CONFIG.with_updates(train={"steps": MIGRATED_STEPS})
    joiners = sum(len(s.moves) for s in SCENARIOS)
    with LocalJob.launch(config, run_dir, standbys=joiners, limit=SCENARIOS[0].prepare_at) as job:
        run = Run(run_dir, {})
        # Every standby warms up for every role type (after step 1, whose pipeline
        # tensors live ranks recorded) before any of them joins.
        job.wait_step(2)
        run.warmed = job.warm(timeout_s=WAIT_S)
        for scenario in SCENARIOS:
            run.migrations.append(migrate(job, scenario))
        job.finish()
        run.losses = job.losses()
        return run


def _fault_env(faults: list[tuple[str, int, str]]) -> dict[str, str]:
    return {"TM_TEST_FAULT": ",".join(f"{m}@{step}:{point}" for m, step, point in faults)}


def _recover_all(job: LocalJob, run: Run, count: int) -> None:
    for _ in range(count):
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        run.recoveries.append(job.recover(dead, detected_at=noticed, timeout_s=WAIT_S))
    job.finish(timeout_s=WAIT_S)
    run.losses = job.losses()
    run.aborted = dict(job.tracker.aborted)
    run.collective_errors = list(job.tracker.collective_errors)
    run.history = list(job.tracker.history)


@pytest.fixture(scope="session")
def failure_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("failures")
    config = CONFIG.with_updates(train={"steps": MIGRATED_STEPS})
    with LocalJob.launch(
        config,
        run_dir,
        standbys=len(FAULTS),
        timeout_s=WAIT_S,
        extra_env=_fault_env(FAULTS),
        limit=HELD_AT,
    ) as job:
        run = Run(run_dir, {})
        job.set_limit(config.train.steps)  # every worker said hello: the faults may come
        _recover_all(job, run, len(FAULTS))
        return run


@pytest.fixture(scope="session")
def checkpoint_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("checkpoint")
    config = CONFIG.with_updates(
        layout={"tp": 2, "pp": 2, "dp": 1},
        cluster={"machines": ["m0", "m1"]},
        train={"steps": 16, "dump_steps": []},
        runtime={"checkpoint_every": CHECKPOINT_EVERY},
    )
    with LocalJob.launch(
        config,
        run_dir,
        standbys=1,
        timeout_s=WAIT_S,
        extra_env=_fault_env([CHECKPOINT_FAULT]),
        limit=HELD_AT,
    ) as job:
        run = Run(run_dir, {})
        job.set_limit(config.train.steps)  # every worker said hello: the fault may come
        _recover_all(job, run, 1)
        return run
