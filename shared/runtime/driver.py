"""Local driver: runs a job of real worker processes on loopback and migrates machines.

`LocalJob` plays the control plane for one job before the services exist (and is what
tests and the benchmark use): it launches M machines x G ranks plus standby machines,
answers their hello with roles and generation-0 groups, keeps the group generations and
the machine -> cell assignment, and drives a planned migration through the control API:
prepare (phase 1) -> ready -> commit(k) (phase 2) -> switched; warms standbys (shadow
iterations); and recovers from a machine failure: detect -> recover(plan) to every live
rank -> switched, with state from a DP replica, or the last checkpoint when DP=1. The
sidecar sends the same commands over the same channel (`RankCommands`).

Waits are on events from the workers with deadlines; a worker that dies fails the wait
at once with the tail of its log instead of letting it run into its deadline. What a
migration or recovery reported: `trainmover.runtime.reports`; a command line over it:
`trainmover.runtime.localrun`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from trainmover.runtime import control as c
from trainmover.runtime import logs
from trainmover.runtime.config import JobConfig, save_config
from trainmover.runtime.launcher import ControlServer, WorkerStarter
from trainmover.runtime.layout import MachineRole, Role
from trainmover.runtime.plan import Plan, RankRef, compute_delta, group_specs
from trainmover.runtime.rendezvous import RendezvousHost
from trainmover.runtime.reports import MigrationReport, RecoveryReport
from trainmover.runtime.supervisor import RankCommands, RankTracker, stop_processes

REFERENCE_ENTRY = "trainmover.runtime.reference"
T = TypeVar("T")


class LocalJob:
    """One job's worker processes and the control-plane state that drives them."""

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
        self.log = logs.get_logger(job=config.job, component="driver")
        self.layout = config.layout
        cells = self.layout.cells()
        #: Active machines -> the (dp, pp) cell each serves.
        self.assignment: dict[str, MachineRole] = {f"m{i}": cell for i, cell in enumerate(cells)}
        self.standbys: list[str] = []
        self.generations: dict[str, int] = dict.fromkeys(self.layout.all_groups(), 0)
        self.limit = config.train.steps if limit is None else limit
        self._plan_ids = itertools.count(1)
        self._recovery_ids = itertools.count(1)
        self._standby_ids = itertools.count(0)

        #: What the workers reported, and their processes.
        self.tracker = RankTracker(self.run_dir)
        self._starter = WorkerStarter(self.run_dir, "job")
        t = self.tracker
        self.last_step, self.steps, self.exited, self.procs = (
            t.last_step,
            t.steps,
            t.exited,
            t.procs,
        )
        self.ready, self.switched, self.failed = t.ready, t.switched, t.failed

        self._config_path = save_config(config, self.run_dir / "job.json")
        self._rendezvous = None if store_address else RendezvousHost()
        self.store_address = store_address or self._rendezvous.address  # type: ignore[union-attr]
        self.control = ControlServer(
            self._welcome, self.tracker.on_event, on_disconnect=self.tracker.on_disconnect
        )
        self.commands = RankCommands(self.control, self.tracker, timeout_s)
        try:
            for machine in self.assignment:
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

    # -- processes ---------------------------------------------------------------------

    def _spawn_machine(self, machine: str) -> None:
        group = 0  # a new process group per machine: it dies (or is killed) as a whole
        env = dict(self.extra_env)
        if self.private_compile_caches:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(self.run_dir / "machines" / machine / "inductor")
        for local_rank in range(self.layout.ranks_per_machine):
            ref = RankRef(machine=machine, local_rank=local_rank)
            proc = self._starter.spawn(
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
        """Starts `count` standby machines (they connect and wait for a plan)."""
        names = [f"s{next(self._standby_ids)}" for _ in range(count)]
        for name in names:
            self.standbys.append(name)
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
                except Exception:
                    pass
        stop_processes(self.procs.values())
        self._starter.close()
        self.control.close()
        if self._rendezvous is not None:
            self._rendezvous.close()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- control-plane answers ---------------------------------------------------------

    def _welcome(self, hello: c.Hello) -> c.Welcome:
        cell = self.assignment.get(hello.machine)
        me = RankRef(machine=hello.machine, local_rank=hello.local_rank)
        if cell is None:
            role, groups = None, []
        else:
            role = Role(dp=cell.dp, pp=cell.pp, tp=hello.local_rank)
            groups = [
                s
                for s in group_specs(self.layout, self.assignment, self.generations)
                if s.group_rank(me) is not None
            ]
        return c.Welcome(
            job=self.config.job,
            role=role,
            groups=groups,
            limit=self.limit,
            # A standby learns the store only when it joins (prepare/recover): its shadow
            # iterations have no path to the live job.
            store=self.store_address if role is not None else "",
        )

    def _wait(self, predicate: Callable[[], T], timeout_s: float | None, what: str) -> T:
        """Waits for `predicate` to be truthy, failing fast if a worker died."""
        return self.tracker.wait(predicate, timeout_s or self.timeout_s, what)

    def _check_alive(self) -> None:
        self.tracker.check_alive()

    # -- training progress -------------------------------------------------------------

    def set_limit(self, limit: int) -> None:
        """Lets every live rank (standbys included) run through step `limit`."""
        self.limit = limit
        for ref in self._live():
            # A worker not connected yet gets the new limit in its welcome.
            if ref in self.control.connected():
                self.control.request(ref, c.Advance(limit=limit), self.timeout_s)

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
        refs = list(self.procs)
        self._wait(
            lambda: all(self.procs[r].poll() is not None for r in refs),
            timeout_s,
            "all workers to exit",
        )
        self._check_alive()

    def stop_at(self, step: int, timeout_s: float | None = None) -> None:
        """Ends the job after `step` (before its configured last step): every rank is
        held at that boundary first, so all stop at the same step and none is left
        waiting in a collective for a peer that already stopped."""
        self.wait_connected(timeout_s)  # a standby still starting must get the stop too
        self.set_limit(step)
        self.wait_step(step, timeout_s=timeout_s)
        for ref in self._live():
            self.control.request(ref, c.Stop(), self.timeout_s)
        refs = list(self.procs)
        self._wait(
            lambda: all(self.procs[r].poll() is not None for r in refs),
            timeout_s,
            "all workers to exit",
        )
        self._check_alive()

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

    # -- migration -----------------------------------------------------------------------

    def make_plan(self, moves: dict[str, str], full: bool = False) -> Plan:
        """The plan moving each leaver to its joiner (leaver -> joiner)."""
        return compute_delta(
            job=self.config.job,
            plan_id=f"p{next(self._plan_ids)}",
            layout=self.layout,
            assignment=self.assignment,
            generations=self.generations,
            moves=moves,
            full=full,
        )

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
        """Until every affected rank switched; then records the new assignment and
        generations (the control plane's side of the commit)."""
        refs = self.affected_ranks(plan)
        self.commands.wait_switched(refs, plan, timeout_s)
        leavers = self.ranks(plan.leavers())
        self._wait(
            lambda: all(self.procs[r].poll() is not None for r in leavers),
            timeout_s,
            "leavers to exit",
        )
        for move in plan.moves:
            del self.assignment[move.leaver]
            self.assignment[move.joiner] = move.cell
            self.standbys.remove(move.joiner)
        for spec in plan.groups:
            self.generations[spec.name] = spec.generation
        self.log.info(
            "switched",
            plan_id=plan.plan_id,
            rebuilt_groups=len(plan.groups),
            rebuilt=[g.name for g in plan.groups],
            ranks=len(refs),
        )
        return dict(self.switched[plan.plan_id])

    def migrate(
        self,
        moves: dict[str, str],
        at_step: int | None = None,
        margin: int = 2,
        full: bool = False,
        timeout_s: float | None = None,
    ) -> MigrationReport:
        """A whole planned migration.

        With `at_step`, the switch happens exactly at the boundary after that step: the
        job may run up to it during phase 1 and is held there if phase 1 is not ready yet
        (that wait is downtime); afterwards the limit is the larger of the previous one
        and `at_step`. Without it, the switch step is `margin` steps past the furthest
        rank once phase 1 is ready (ahead of the slowest worker, so no rank has passed
        it when the commit arrives), and training never waits for the plan."""
        plan = self.make_plan(moves, full=full)
        self.log.info(
            "plan", plan_id=plan.plan_id, moves=moves, delta=[g.name for g in plan.groups]
        )
        resume_limit = self.limit
        if at_step is not None:
            if at_step < self.current_step():
                raise ValueError(f"step {at_step} is already past")
            self.set_limit(at_step)
        prepare_sent = time.time()
        acks = self.prepare(plan)
        ready = self.wait_ready(plan, timeout_s)
        ready_at = time.time()
        # Never beyond the limit: a rank held there could not reach the switch step.
        step = at_step if at_step is not None else min(self.current_step() + margin, self.limit)
        commit_sent = time.time()
        self.commit(plan, step)
        commit_acked = time.time()
        if at_step is not None:
            self.set_limit(max(resume_limit, at_step))
        switched = self.wait_switched(plan, timeout_s)
        return MigrationReport(
            plan, step, prepare_sent, ready, ready_at, commit_sent, commit_acked, switched, acks
        )

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

    def abort(self, reason: str = "aborted by the driver") -> dict[RankRef, c.AbortAck]:
        """Aborts the in-flight step of the current epoch on every live active rank."""
        refs = [r for r in self.ranks() if r in self._live()]
        epochs = {s.epoch for s in self.commands.status(refs[:1]).values()}
        return self.commands.abort(refs, epochs.pop(), reason)

    def wait_failure(self, timeout_s: float | None = None) -> tuple[str, float]:
        """Until a worker of an active machine dies; returns that machine and when it was
        noticed (its control connection closing is usually the first sign). Its ranks
        are then known lost."""

        def dead_machine() -> str | None:
            dead = [r for r in self.tracker.dead() if r.machine in self.assignment]
            gone = [r for r in self.tracker.disconnected if r.machine in self.assignment]
            gone = [r for r in gone if r not in self.tracker.lost and r not in self.exited]
            return (dead or gone)[0].machine if dead or gone else None

        machine = self.tracker.wait(dead_machine, timeout_s or self.timeout_s, "a failure", [])
        assert machine is not None
        noticed = time.time()
        self.tracker.mark_lost(self.ranks([machine]))
        return machine, noticed

    def replica_of(self, machine: str) -> str | None:
        """An active machine holding the same roles in another DP replica."""
        cell = self.assignment[machine]
        return next(
            (
                m
                for m, other in sorted(self.assignment.items())
                if other.pp == cell.pp and other.dp != cell.dp
            ),
            None,
        )

    def recover(
        self,
        dead: str,
        joiner: str | None = None,
        detected_at: float | None = None,
        timeout_s: float | None = None,
    ) -> RecoveryReport:
        """The unplanned path: `dead` failed. A standby takes its roles; its state comes
        from a DP replica, or (DP=1) every rank reloads the last common checkpoint."""
        detected_at = detected_at or time.time()
        self.tracker.mark_lost(self.ranks([dead]))
        joiner = joiner or self.standbys[0]
        replica = self.replica_of(dead)
        plan = compute_delta(
            job=self.config.job,
            plan_id=f"r{next(self._recovery_ids)}",
            layout=self.layout,
            assignment=self.assignment,
            generations=self.generations,
            moves={dead: joiner},
            sources={dead: replica} if replica else None,
            restore="transfer" if replica else "checkpoint",
        )
        refs = self.ranks((set(self.assignment) - {dead}) | {joiner})
        self.log.info("recover", plan_id=plan.plan_id, dead=dead, joiner=joiner, source=replica)
        recover_sent = time.time()
        acks = self.commands.recover(refs, plan, store=self.store_address)
        switched = self.commands.wait_switched(refs, plan, timeout_s)
        del self.assignment[dead]
        self.assignment[joiner] = plan.moves[0].cell
        self.standbys.remove(joiner)
        for spec in plan.groups:
            self.generations[spec.name] = spec.generation
        return RecoveryReport(plan, dead, detected_at, recover_sent, acks, switched)
