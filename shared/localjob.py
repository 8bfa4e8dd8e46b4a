"""The in-process harness: one job of real worker processes on loopback, driven by the
control plane's own classes wired together in this process, with no bus between them.

What decides is what the services run:

- the planner's decisions (`trainmover.services.planner`): every plan with its delta and
  group generations, a recovery's joiner and state source (a data-parallel replica, or
  the last checkpoint when there is none), and the cluster state after each migration;
- the executor's `Migration` state machine: the phases, the switch step and its commit
  rounds, the downtime measure; its commands reach the machines over an in-memory
  transport instead of NATS (`trainmover.localexec`);
- each machine's `MachineWorkers` (the sidecar's side): the answer to a worker's hello
  and every command on its ranks; all machines share one control server and fork server.

What the harness adds is what tests and benchmarks need around them: machines launched
each as one process group (to be killed as a whole), a step limit that holds training,
a failure noticed from a worker's control connection closing (the health monitor's job
in the full system) and, for protocol tests that interleave the commands by hand, the
commands themselves (`prepare`, `commit`, `wait_switched`) over the planner's plans.
Waits are on events from the workers with deadlines; a worker that dies fails the wait at
once with the tail of its log. What a migration or recovery reported:
`trainmover.runtime.reports`; the whole system as separate processes:
`trainmover.localcluster`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from trainmover.localexec import InMemoryExecutor
from trainmover.messages import ClusterState, FailureEvent, MigrationProgress, Plan
from trainmover.runtime import control as c
from trainmover.runtime import logs
from trainmover.runtime.config import JobConfig, save_config
from trainmover.runtime.launcher import REFERENCE_ENTRY
from trainmover.runtime.layout import MachineRole
from trainmover.runtime.plan import RankRef
from trainmover.runtime.rendezvous import RendezvousHost
from trainmover.runtime.reports import MigrationReport, RecoveryReport
from trainmover.runtime.supervisor import stop_processes
from trainmover.services.executor.migration import MigrationRecord
from trainmover.services.planner.cluster import initial_state, role_holders, set_machine
from trainmover.services.planner.decisions import Planner
from trainmover.services.planner.plans import make_plan
from trainmover.services.sidecar.workers import MachineWorkers, WorkerChannel

T = TypeVar("T")


class LocalJob:
    """One job's worker processes and the control plane that drives them, in-process."""

    def __init__(
        self,
        config: JobConfig,
        run_dir: Path,
        standbys: int = 1,
        limit: int | None = None,
        entry: str = REFERENCE_ENTRY,
        store_address: str | None = None,
        timeout_s: float = 120.0,
        extra_env: dict[str, str] | None = None,
        private_compile_caches: bool = False,
    ):
        self.config = config
        self.extra_env = extra_env or {}
        #: Each machine compiles into its own inductor cache (as separate hosts do);
        #: otherwise all share this host's, and a standby would find the kernels its
        #: live peers compiled on disk (no cold joiner to measure).
        self.private_compile_caches = private_compile_caches
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.entry = entry
        self.timeout_s = timeout_s
        self.log = logs.get_logger(job=config.job, component="localjob")
        self.layout = config.layout
        self.planner = Planner()
        #: The planner's view of the job, edited only by the planner's own functions.
        self.state: ClusterState = initial_state(config)
        self._standby_order: list[str] = []
        self.limit = config.train.steps if limit is None else limit
        self._events = itertools.count(1)
        self._standby_ids = itertools.count(0)

        self._config_path = save_config(config, self.run_dir / "job.json")
        self._rendezvous = None if store_address else RendezvousHost()
        self.store_address = store_address or self._rendezvous.address  # type: ignore[union-attr]
        self.channel = WorkerChannel.open(self.run_dir, "job", self._welcome, timeout_s)
        self.tracker, self.control, self.commands = (
            self.channel.tracker,
            self.channel.control,
            self.channel.commands,
        )
        t = self.tracker
        self.last_step, self.steps, self.exited, self.procs = (
            t.last_step,
            t.steps,
            t.exited,
            t.procs,
        )
        self.ready, self.switched, self.failed = t.ready, t.switched, t.failed
        self.machines: dict[str, MachineWorkers] = {}
        self.executor = InMemoryExecutor(self.machines, lambda: role_holders(self.state), timeout_s)
        self.executor.on_commit = self._reach
        try:
            for machine in config.cluster.machines:
                self._spawn_machine(machine)
            self.add_standbys(standbys)
        except BaseException:
            self.close()
            raise

    @classmethod
    def launch(cls, config: JobConfig, run_dir: Path, **kwargs: Any) -> LocalJob:
        """Starts the job and returns once every worker has said hello."""
        job = cls(config, run_dir, **kwargs)
        try:
            job.wait_connected()
        except BaseException:
            job.close()
            raise
        return job

    # -- the planner's view --------------------------------------------------------------

    @property
    def assignment(self) -> dict[str, MachineRole]:
        """Active machines -> the (dp, pp) cell each serves."""
        return {
            n: m.cell
            for n, m in self.state.machines.items()
            if m.status == "active" and m.cell is not None
        }

    @property
    def standbys(self) -> list[str]:
        """Machines in the standby pool, in the order they were started."""
        machines = self.state.machines
        return [n for n in self._standby_order if machines[n].status == "standby"]

    @property
    def generations(self) -> dict[str, int]:
        return {g: self.state.generations.get(g, 0) for g in self.layout.all_groups()}

    # -- processes ---------------------------------------------------------------------

    def _spawn_machine(self, machine: str) -> None:
        workers = MachineWorkers(
            machine,
            self.config,
            self.run_dir,
            self.store_address,
            lambda: self.state,
            self.entry,
            self.timeout_s,
            channel=self.channel,
            limit=lambda: self.limit,
        )
        self.machines[machine] = workers
        group = 0  # a new process group per machine: it dies (or is killed) as a whole
        env = dict(self.extra_env)
        if self.private_compile_caches:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(self.run_dir / "machines" / machine / "inductor")
        for ref in workers.refs:
            proc = self.channel.starter.spawn(
                ref,
                self.entry,
                self.control.address,
                self._config_path,
                self.run_dir,
                env,
                process_group=group,
            )
            group = group or proc.pid
            self.tracker.add_process(ref, proc)

    def add_standbys(self, count: int) -> list[str]:
        """Starts `count` standby machines (they connect and wait for a plan). The pool
        offers each for every role type: the harness does not make a join wait for
        shadow iterations (`warm` runs them)."""
        names = [f"s{next(self._standby_ids)}" for _ in range(count)]
        types = list(self.layout.role_types())
        for name in names:
            self.state = set_machine(self.state, name, status="standby", warm_role_types=types)
            self._standby_order.append(name)
            self._spawn_machine(name)
        return names

    def ranks(self, machines: Iterable[str] | None = None) -> list[RankRef]:
        machines = self.assignment if machines is None else machines
        return [
            RankRef(machine=m, local_rank=i)
            for m in sorted(machines)
            for i in range(self.layout.ranks_per_machine)
        ]

    def wait_connected(self, timeout_s: float | None = None) -> None:
        """Until every process that has not exited (leavers have) has said hello."""
        expected = {r for r in self.procs if r not in self.exited and r not in self.tracker.lost}
        self._wait(lambda: expected <= self.control.connected(), timeout_s, "hello from all")

    def close(self) -> None:
        """Stops everything still running: stop, then terminate, then kill."""
        for ref, proc in self.procs.items():
            if proc.poll() is None and ref in self.control.connected():
                try:
                    self.control.request(ref, c.Stop(), timeout_s=2)
                except Exception:  # noqa: S110 - it is being stopped either way
                    pass
        stop_processes(self.procs.values())
        self.channel.close()
        if self._rendezvous is not None:
            self._rendezvous.close()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _welcome(self, hello: c.Hello) -> c.Welcome:
        return self.machines[hello.machine].welcome(hello)

    def _wait(self, predicate: Callable[[], T], timeout_s: float | None, what: str) -> T:
        """Waits for `predicate` to be truthy, failing fast if a worker died."""
        return self.tracker.wait(predicate, timeout_s or self.timeout_s, what)

    # -- training progress -------------------------------------------------------------

    def set_limit(self, limit: int) -> None:
        """Lets every live rank (standbys included) run through step `limit`."""
        self.limit = limit
        for ref in self._live():
            # A worker not connected yet gets the new limit in its welcome.
            if ref in self.control.connected():
                try:
                    self.control.request(ref, c.Advance(limit=limit), self.timeout_s)
                except ConnectionError:
                    # Fine if it trained to the last step and exited cleanly meanwhile.
                    if self.procs[ref].wait(timeout=self.timeout_s) != 0:
                        raise

    def _reach(self, step: int) -> None:
        """A switch step past the hold: let every rank train to it and the one after."""
        if self.limit < step:
            self.set_limit(step + 1)

    def wait_step(
        self, step: int, machines: Iterable[str] | None = None, timeout_s: float | None = None
    ) -> None:
        """Until every rank of `machines` (default: all active) completed `step`."""
        refs = self.ranks(machines)
        self._wait(
            lambda: all(self.last_step.get(r, 0) >= step for r in refs), timeout_s, f"step {step}"
        )

    def current_step(self) -> int:
        return max((self.tracker.step_of(r) for r in self.ranks()), default=0)

    def status(self, digest: bool = False) -> dict[RankRef, c.RankStatus]:
        return self.commands.status(self.ranks(), digest=digest)

    def finish(self, timeout_s: float | None = None) -> None:
        """Runs the job to its last step and waits for every worker to exit cleanly;
        standbys never used are stopped."""
        self.set_limit(self.config.train.steps)
        for ref in self.ranks(self.standbys):
            self.control.request(ref, c.Stop(), self.timeout_s)
        self._wait_all_exited(timeout_s)

    def stop_at(self, step: int, timeout_s: float | None = None) -> None:
        """Ends the job after `step` (before its configured last step): every rank is
        held at that boundary first, so all stop at the same step and none is left
        waiting in a collective for a peer that already stopped."""
        self.wait_connected(timeout_s)  # a standby still starting must get the stop too
        self.set_limit(step)
        self.wait_step(step, timeout_s=timeout_s)
        for ref in self._live():
            self.control.request(ref, c.Stop(), self.timeout_s)
        self._wait_all_exited(timeout_s)

    def _wait_all_exited(self, timeout_s: float | None) -> None:
        refs = list(self.procs)
        self._wait(
            lambda: all(self.procs[r].poll() is not None for r in refs),
            timeout_s,
            "all workers to exit",
        )
        self.tracker.check_alive()

    def losses(self) -> dict[int, float]:
        """Mean loss over the DP replicas' last stages, by step."""
        out = {}
        for step, by_rank in sorted(self.steps.items()):
            values = [e.loss for e in by_rank.values() if e.loss is not None]
            if values:
                out[step] = sum(values) / len(values)
        return out

    def _live(self) -> list[RankRef]:
        return [
            r
            for r, p in self.procs.items()
            if p.poll() is None and r not in self.exited and r not in self.tracker.lost
        ]

    # -- migrations: the planner plans, the executor's Migration runs them ---------------

    def make_plan(self, moves: dict[str, str], full: bool = False) -> Plan:
        """The planner's plan moving each leaver to its joiner (leaver -> joiner), now in
        flight in its state (`full`: every group of the job rebuilt, an ablation)."""
        outcome = make_plan(
            self.state,
            f"local-{next(self._events)}",
            "planned",
            moves,
            {leaver: leaver for leaver in moves},
            time.time(),
            None,
            full=full,
        )
        self.state = outcome.state
        return outcome.plans[0]

    def migrate(
        self,
        moves: dict[str, str],
        at_step: int | None = None,
        margin: int = 2,
        full: bool = False,
        timeout_s: float | None = None,
    ) -> MigrationReport:
        """A whole planned migration, run by the executor's `Migration`.

        With `at_step`, the switch happens exactly at the boundary after that step: the
        job may run up to it during phase 1 and is held there if phase 1 is not ready yet
        (that wait is downtime), until the commit is taken; afterwards the limit is the
        larger of the previous one and the step after `at_step` (the executor measures the
        downtime on it). Without it, the executor picks the
        switch step (`margin` steps past the furthest rank once phase 1 is ready), and
        training never waits for the plan: a job held short of that step is let run to
        it (phase 1 may last longer than the steps the hold left)."""
        current = self.current_step()
        if at_step is not None and at_step < current:
            raise ValueError(f"step {at_step} is already past")
        plan = self.make_plan(moves, full=full)
        self.log.info(
            "plan", plan_id=plan.plan_id, moves=moves, delta=[g.name for g in plan.groups]
        )
        if at_step is not None:
            resume = self.limit
            self.set_limit(at_step)
            self.executor.on_committed = lambda: self.set_limit(max(resume, at_step + 1))
        record, stamps = self._run(plan, at_step, margin, timeout_s)
        phases = record.phases
        prepare_sent = stamps["phase1"]
        ready_at = prepare_sent + phases["prepare"]
        return MigrationReport(
            plan=plan,
            commit_step=int(record.commit_step or 0),
            prepare_sent=prepare_sent,
            ready=dict(self.ready[plan.plan_id]),
            ready_at=ready_at,
            commit_sent=ready_at,
            commit_acked=ready_at + phases["commit"],
            switched=dict(self.switched[plan.plan_id]),
        )

    def recover(
        self, dead: str, detected_at: float | None = None, timeout_s: float | None = None
    ) -> RecoveryReport:
        """The unplanned path: `dead` failed. The planner decides the recovery (a standby
        takes its roles, its state from a DP replica, or every rank reloads the last
        common checkpoint when there is none) and the executor's `Migration` runs it."""
        detected_at = detected_at or time.time()
        self.tracker.mark_lost(self.ranks([dead]))
        event = FailureEvent(
            event_id=f"local-{next(self._events)}",
            job=self.config.job,
            machine=dead,
            reason="its workers died",
        )
        outcome = self.planner.on_event(self.state, event, time.time())
        if not outcome.plans:
            why = "; ".join(p.detail for p in outcome.progress) or outcome.refused
            raise RuntimeError(f"no recovery for {dead}: {why}")
        self.state = outcome.state
        plan = outcome.plans[0]
        self.log.info("recover", plan_id=plan.plan_id, dead=dead, moves=plan.moves)
        recover_sent = time.time()
        self._run(plan, None, 2, timeout_s)
        return RecoveryReport(
            plan, dead, detected_at, recover_sent, dict(self.switched[plan.plan_id])
        )

    def _run(
        self, plan: Plan, commit_step: int | None, margin: int, timeout_s: float | None
    ) -> tuple[MigrationRecord, dict[str, float]]:
        """Runs `plan` to its end; the planner then applies that end to the state."""
        try:
            out = self.executor.run(plan, commit_step, margin, timeout_s or self.timeout_s)
        finally:
            self.executor.on_committed = None
        self._ended(plan)
        return out

    def _ended(self, plan: Plan) -> None:
        """The planner's side of a migration's end: roles, generations, statuses."""
        done = MigrationProgress(
            job=plan.job, event_id=plan.event_id, plan_id=plan.plan_id, state="done"
        )
        self.state = self.planner.on_progress(self.state, done, time.time()).state
        self.log.info(
            "switched",
            plan_id=plan.plan_id,
            rebuilt_groups=len(plan.groups),
            rebuilt=[g.name for g in plan.groups],
        )

    # -- the protocol's commands by hand (tests that interleave them) --------------------

    def affected_ranks(self, plan: Plan) -> list[RankRef]:
        """Every rank with work in `plan`: leavers, joiners, and stayers of the delta."""
        return [r for r in self.ranks(plan.affected_machines()) if plan.specs_for(r)]

    def prepare(
        self, plan: Plan, machines: Iterable[str] | None = None
    ) -> dict[RankRef, c.PrepareAck]:
        """Phase 1 on the affected ranks (of `machines` only, when given)."""
        chosen = set(plan.affected_machines() if machines is None else machines)
        refs = [r for r in self.affected_ranks(plan) if r.machine in chosen]
        acks = self.commands.prepare(refs, plan, store=self.store_address)
        return {r: a for r, a in acks.items() if isinstance(a, c.PrepareAck)}

    def wait_ready(self, plan: Plan, timeout_s: float | None = None) -> dict[RankRef, c.Ready]:
        return self.commands.wait_ready(self.affected_ranks(plan), plan, timeout_s)

    def commit(self, plan: Plan, step: int) -> dict[RankRef, c.CommitAck]:
        """Phase 2: every affected rank switches at the boundary after `step`; a refusal
        (a rank already past it) fails the plan."""
        self.log.info("commit", plan_id=plan.plan_id, step=step)
        return self.commands.commit(self.affected_ranks(plan), plan, step)

    def wait_switched(
        self, plan: Plan, timeout_s: float | None = None
    ) -> dict[RankRef, c.Switched]:
        """Until every affected rank switched and the leavers exited; then the planner
        applies the migration's end to the state."""
        self.commands.wait_switched(self.affected_ranks(plan), plan, timeout_s)
        leavers = self.ranks(plan.leavers())
        self._wait(
            lambda: all(self.procs[r].poll() is not None for r in leavers),
            timeout_s,
            "leavers to exit",
        )
        self._ended(plan)
        return dict(self.switched[plan.plan_id])

    # -- warm-up and unplanned failures --------------------------------------------------

    def warm(
        self,
        machines: Iterable[str] | None = None,
        role_types: list[str] | None = None,
        iterations: int = 2,
        timeout_s: float | None = None,
    ) -> dict[RankRef, c.Warmed]:
        """Shadow iterations on standbys (default: all, for every role type)."""
        refs = self.ranks(self.standbys if machines is None else machines)
        self.wait_connected(timeout_s)
        types = role_types or list(self.layout.role_types())
        return self.commands.warm(refs, types, iterations, timeout_s)

    def abort(self, reason: str = "aborted by the harness") -> dict[RankRef, c.AbortAck]:
        """Aborts the in-flight step of the current epoch on every live active rank."""
        refs = [r for r in self.ranks() if r in self._live()]
        epochs = {s.epoch for s in self.commands.status(refs[:1]).values()}
        return self.commands.abort(refs, epochs.pop(), reason)

    def wait_failure(self, timeout_s: float | None = None) -> tuple[str, float]:
        """Until a worker of an active machine dies; returns that machine and when it was
        noticed (its control connection closing is usually the first sign). Its ranks
        are then known lost."""
        active = self.assignment

        def dead_machine() -> str | None:
            dead = [r for r in self.tracker.dead() if r.machine in active]
            gone = [r for r in self.tracker.disconnected if r.machine in active]
            gone = [r for r in gone if r not in self.tracker.lost and r not in self.exited]
            return (dead or gone)[0].machine if dead or gone else None

        machine = self.tracker.wait(dead_machine, timeout_s or self.timeout_s, "a failure", [])
        assert machine is not None
        noticed = time.time()
        self.tracker.mark_lost(self.ranks([machine]))
        return machine, noticed
