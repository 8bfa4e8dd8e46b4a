"""The runtime inside a worker process: the integration surface of a training loop.

A loop runs under TrainMover with a few lines (see `trainmover.runtime.reference`)::

    with Runtime.from_env() as rt:
        role = rt.wait_for_role()            # a standby blocks here until a plan names it
        if role is None:
            return                           # released without ever being needed
        model, optimizer, data = build(role, group_of=lambda: rt.groups["tp"])
        rt.track(model, optimizer, stateful={"data": data}, generators={"dropout": gen})
        for step in rt.steps():              # boundaries: switches, transfer, holds, stop
            loss = train_one_step(model, optimizer, data.next_batch(), rt.groups)
            rt.report(loss=loss)

`Runtime` answers the control API (`trainmover.runtime.control`) on a reader thread and
does everything that touches training at step boundaries, on the training thread:
phase 1 (prepare) only starts a background group builder, and phase 2 (commit) only
records the switch step; the switch itself, the state transfer and the exit of a leaver
happen in `steps()` between two steps.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from trainmover.runtime import control as c
from trainmover.runtime import logs
from trainmover.runtime.config import JobConfig, load_config
from trainmover.runtime.groups import Group, GroupBuilder, GroupTable, pick_device
from trainmover.runtime.layout import Role
from trainmover.runtime.plan import GroupSpec, Plan, RankRef
from trainmover.runtime.state import Stateful, TrainingState

#: Environment the launcher sets for every worker process.
ENV_CONTROL = "TM_CONTROL"
ENV_MACHINE = "TM_MACHINE"
ENV_LOCAL_RANK = "TM_LOCAL_RANK"
ENV_CONFIG = "TM_CONFIG"
ENV_RUN_DIR = "TM_RUN_DIR"

Part = Literal["leaver", "joiner", "stayer"]


class SupervisorGone(RuntimeError):
    """The control connection closed: nobody can coordinate this rank any more."""


@dataclass
class _Migration:
    """This rank's view of the plan in flight."""

    plan: Plan
    part: Part
    builder: GroupBuilder
    prepared_at_step: int
    commit_step: int | None = None
    steps_during_build: int = 0


def _store_client(address: str, timeout_s: float) -> dist.TCPStore:
    host, port = c.parse_address(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


class Runtime:
    """One worker's runtime. Create with `from_env()` (the launcher's environment) and use
    as a context manager so groups are shut down and the exit is reported."""

    def __init__(
        self, control_address: str, machine: str, local_rank: int, config: JobConfig, run_dir: Path
    ):
        self.config = config
        self.me = RankRef(machine=machine, local_rank=local_rank)
        self.run_dir = run_dir
        self.groups = GroupTable()
        self.device = pick_device(config.runtime.device, local_rank)
        self.role: Role | None = None
        self._cond = threading.Condition()
        self._state: TrainingState | None = None
        self._migration: _Migration | None = None
        self._initial: GroupBuilder | None = None
        self._limit = 0
        self._passed = -1  # last step whose boundary this rank has left
        self._stop = False
        self._orphaned = False
        self._exit_reason: Literal["finished", "left", "error"] = "finished"
        self._loss: float | None = None
        self._step_started = 0.0
        self._timeout_s = config.runtime.group_timeout_s

        torch.set_num_threads(config.runtime.threads)
        logs.configure()
        # A bound logger, not contextvars: the control thread and the builder threads log
        # too, and threads do not inherit context variables.
        self.log = logs.get_logger(
            job=config.job, machine=machine, local_rank=local_rank, pid=os.getpid()
        )
        self._conn = c.Connection(
            c.connect(control_address), on_request=self._on_request, on_close=self._on_close
        ).start()
        welcome = self._conn.request(
            c.Hello(machine=machine, local_rank=local_rank, pid=os.getpid()), self._timeout_s
        )
        assert isinstance(welcome, c.Welcome)
        self._store_address = welcome.store
        self._limit = welcome.limit
        if welcome.role is not None:
            self._take_role(welcome.role)
            # Generation-0 groups build in the background while the user builds the model.
            self._initial = self._builder(welcome.groups, "initial-groups")
        self.log.info("welcome", role=welcome.role and welcome.role.key, limit=self._limit)

    @classmethod
    def from_env(cls) -> Runtime:
        """The runtime of a process started by `trainmover.runtime.launcher`."""
        return cls(
            control_address=os.environ[ENV_CONTROL],
            machine=os.environ[ENV_MACHINE],
            local_rank=int(os.environ[ENV_LOCAL_RANK]),
            config=load_config(os.environ[ENV_CONFIG]),
            run_dir=Path(os.environ[ENV_RUN_DIR]),
        )

    # -- integration surface -----------------------------------------------------------

    def wait_for_role(self, timeout_s: float | None = None) -> Role | None:
        """This rank's role; a standby blocks until a plan assigns one. None when the
        supervisor stopped it first."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.role is not None or self._stop, timeout_s)
            if not ok:
                raise TimeoutError("no role assigned")
            return self.role

    def track(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        stateful: dict[str, Stateful] | None = None,
        generators: dict[str, torch.Generator] | None = None,
    ) -> TrainingState:
        """Registers what a leaver sends its joiner (besides torch's global RNG)."""
        self._state = TrainingState(model, optimizer, stateful or {}, generators or {})
        return self._state

    def report(self, loss: float | None = None) -> None:
        """Attaches the current step's loss to its step event."""
        self._loss = loss

    def steps(self) -> Iterator[int]:
        """Yields step numbers to train; returns when the job is finished or this rank
        left. Switches happen between two yields."""
        if self._state is None:
            raise RuntimeError("call track() before steps()")
        if self._initial is not None:
            self.groups.install(self._initial.wait(self._timeout_s))
            self._initial = None
        if self._migration is not None and self._migration.part == "joiner":
            self._join()
        while self._boundary(self._state.step):
            self._step_started = time.perf_counter()
            yield self._state.step + 1
            self._state.step += 1
            self._conn.notify(
                c.StepDone(
                    step=self._state.step,
                    t_end=time.time(),
                    seconds=time.perf_counter() - self._step_started,
                    loss=self._loss,
                )
            )
            self._loss = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        reason = "error" if exc is not None else self._exit_reason
        self.close(reason, error="" if exc is None else f"{exc_type.__name__}: {exc}")

    def close(
        self, reason: Literal["finished", "left", "error"] = "finished", error: str = ""
    ) -> None:
        """Shuts every group down (explicitly: a gloo group alive at exit can abort the
        process) and reports the exit."""
        self.groups.shutdown()
        step = self._state.step if self._state else 0
        self.log.info("exit", reason=reason, step=step, error=error or None)
        if not self._conn.closed.is_set():
            try:
                self._conn.notify(c.Exited(reason=reason, step=step, error=error))
            except OSError:
                pass
        self._conn.close()

    # -- step boundary -----------------------------------------------------------------

    def _boundary(self, step: int) -> bool:
        """Everything that happens between steps. True: train the next step."""
        while True:
            with self._cond:
                mig = self._migration
                if mig is not None and mig.commit_step == step:
                    action = "switch"
                elif self._stop or step >= self.config.train.steps:
                    action = "finish"
                elif step < self._limit:
                    # Checked and recorded under one lock: a commit for this step can no
                    # longer be accepted once we are past it.
                    self._passed = step
                    if mig is not None and not mig.builder.done:
                        mig.steps_during_build += 1
                    action = "train"
                else:
                    self._cond.wait()
                    continue
            if action == "train":
                self._maybe_dump(step)
                return True
            if action == "finish":
                if self._orphaned:
                    raise SupervisorGone("control connection closed")
                self._maybe_dump(step)
                return False
            if self._switch(step) == "left":
                return False

    def _maybe_dump(self, step: int) -> None:
        if step in self.config.train.dump_steps and self._state and self.role:
            path = self.run_dir / "state" / f"{self.role.key}.step{step}.pt"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                self._state.save(path)

    def _switch(self, step: int) -> Literal["left", "switched"]:
        """Phase 2 at the boundary after `step`, for a leaver or a stayer."""
        mig = self._migration
        assert mig is not None and self._state is not None
        t_start = time.time()
        built = mig.builder.wait(self._timeout_s)
        if mig.part == "leaver":
            transfer = self._transfer_group(built)
            stats = self._state.send(transfer, peer=1)
            transfer.shutdown()
            closed = [str(g["name"]) for g in self.groups.snapshot().values()]
            self.groups.shutdown()
            self._finish_migration(
                c.Switched(
                    plan_id=mig.plan.plan_id,
                    step=step,
                    part="leaver",
                    rebuilt=closed,
                    t_start=t_start,
                    t_end=time.time(),
                    transfer_bytes=stats.bytes,
                    transfer_s=stats.seconds,
                )
            )
            self._exit_reason = "left"
            return "left"
        for old in self.groups.install(built):
            old.shutdown()
        self._finish_migration(
            c.Switched(
                plan_id=mig.plan.plan_id,
                step=step,
                part="stayer",
                rebuilt=[g.name for g in built],
                t_start=t_start,
                t_end=time.time(),
            )
        )
        return "switched"

    def _join(self) -> None:
        """A joiner's phase 2: wait for the commit, receive the leaver's state, install
        its new groups; training then continues from the leaver's step."""
        mig = self._migration
        assert mig is not None and self._state is not None
        with self._cond:
            self._cond.wait_for(lambda: mig.commit_step is not None or self._stop)
            if mig.commit_step is None:
                raise SupervisorGone("stopped before the commit")
        t_start = time.time()
        built = mig.builder.wait(self._timeout_s)
        transfer = self._transfer_group(built)
        stats = self._state.receive(transfer, peer=0)
        transfer.shutdown()
        if self._state.step != mig.commit_step:
            raise RuntimeError(f"leaver sent step {self._state.step}, commit was {mig.commit_step}")
        role_groups = [g for g in built if g.spec.kind != "transfer"]
        self.groups.install(role_groups)
        self._finish_migration(
            c.Switched(
                plan_id=mig.plan.plan_id,
                step=mig.commit_step,
                part="joiner",
                rebuilt=[g.name for g in role_groups],
                t_start=t_start,
                t_end=time.time(),
                transfer_bytes=stats.bytes,
                transfer_s=stats.seconds,
            )
        )

    def _transfer_group(self, built: list[Group]) -> Group:
        return next(g for g in built if g.spec.kind == "transfer")

    def _finish_migration(self, event: c.Switched) -> None:
        self.log.info(
            "switched",
            plan_id=event.plan_id,
            part=event.part,
            step=event.step,
            rebuilt=event.rebuilt,
            transfer_bytes=event.transfer_bytes,
            seconds=round(event.t_end - event.t_start, 4),
        )
        with self._cond:
            self._migration = None
        self._conn.notify(event)

    # -- control API (reader thread) ---------------------------------------------------

    def _on_request(self, msg: c.Message) -> c.Message:
        if isinstance(msg, c.Prepare):
            return self._prepare(msg.plan)
        if isinstance(msg, c.Commit):
            return self._commit(msg.plan_id, msg.step)
        with self._cond:
            if isinstance(msg, c.Advance):
                self._limit = msg.limit
            elif isinstance(msg, c.Stop):
                self._stop = True
            elif isinstance(msg, c.Status):
                return c.RankStatus(
                    machine=self.me.machine,
                    local_rank=self.me.local_rank,
                    role=self.role,
                    step=self._state.step if self._state else 0,
                    limit=self._limit,
                    groups=self.groups.snapshot(),
                    plan_id=self._migration.plan.plan_id if self._migration else None,
                )
            else:
                raise ValueError(f"unexpected request {msg.TYPE}")
            self._cond.notify_all()
        return c.Ack()

    def _prepare(self, plan: Plan) -> c.PrepareAck:
        """Phase 1: start building my groups of the delta in the background."""
        with self._cond:
            if self._migration is not None:
                if self._migration.plan.plan_id == plan.plan_id:  # idempotent retry
                    return c.PrepareAck(
                        step=self._passed, building=[s.name for s in self._migration.builder.specs]
                    )
                raise RuntimeError(f"plan {self._migration.plan.plan_id} still in flight")
            if self.me.machine in plan.leavers():
                part: Part = "leaver"
            elif self.me.machine in plan.joiners():
                part = "joiner"
            else:
                part = "stayer"
            specs = plan.specs_for(self.me)
            self._check_generations(specs, part)
            if part == "joiner":
                move = plan.move_of(self.me.machine)
                assert move is not None
                self._take_role(move.roles[self.me.local_rank])
            builder = self._builder(specs, f"prepare-{plan.plan_id}")
            self._migration = _Migration(plan, part, builder, prepared_at_step=self._passed)
            self._cond.notify_all()
        self.log.info("prepare", plan_id=plan.plan_id, part=part, building=[s.name for s in specs])
        threading.Thread(target=self._report_ready, args=(self._migration,), daemon=True).start()
        return c.PrepareAck(step=self._passed, building=[s.name for s in specs])

    def _check_generations(self, specs: list[GroupSpec], part: Part) -> None:
        """A stayer only moves its groups one generation forward: a stale or replayed plan
        is refused here, before anything is built."""
        if part != "stayer":
            return
        for spec in specs:
            current = self.groups.get(spec.kind)
            if current is not None and spec.generation != current.generation + 1:
                raise ValueError(
                    f"{spec.name}: plan generation {spec.generation}, current {current.generation}"
                )

    def _report_ready(self, mig: _Migration) -> None:
        try:
            built = mig.builder.wait(self._timeout_s)
        except Exception as exc:
            self.log.error("prepare_failed", plan_id=mig.plan.plan_id, error=str(exc))
            self._conn.notify(c.PlanFailed(plan_id=mig.plan.plan_id, error=str(exc)))
            return
        self.log.info(
            "ready",
            plan_id=mig.plan.plan_id,
            build_s=round(mig.builder.elapsed_s, 4),
            steps_during_build=mig.steps_during_build,
        )
        self._conn.notify(
            c.Ready(
                plan_id=mig.plan.plan_id,
                built=[g.name for g in built],
                build_s=mig.builder.elapsed_s,
                steps_during_build=mig.steps_during_build,
            )
        )

    def _commit(self, plan_id: str, step: int) -> c.CommitAck:
        with self._cond:
            mig = self._migration
            if mig is None or mig.plan.plan_id != plan_id:
                return c.CommitAck(accepted=False, passed=self._passed, reason="unknown plan")
            if not mig.builder.done or mig.builder.error is not None:
                return c.CommitAck(accepted=False, passed=self._passed, reason="not ready")
            if mig.part != "joiner" and step <= self._passed:
                return c.CommitAck(accepted=False, passed=self._passed, reason="too late")
            mig.commit_step = step
            self._cond.notify_all()
        self.log.info("commit", plan_id=plan_id, step=step)
        return c.CommitAck(accepted=True, passed=self._passed)

    def _on_close(self) -> None:
        with self._cond:
            self._stop = self._orphaned = True
            self._cond.notify_all()

    # -- helpers -----------------------------------------------------------------------

    def _take_role(self, role: Role) -> None:
        self.role = role
        self.log = self.log.bind(role=role.key, rank=self.config.layout.global_rank(role))

    def _builder(self, specs: list[GroupSpec], name: str) -> GroupBuilder:
        # A store connection of its own: the builder thread must not share a client
        # with anything else running meanwhile.
        store = _store_client(self._store_address, self._timeout_s)
        return GroupBuilder(
            specs, self.me, store, self.config.job, self.device, self._timeout_s
        ).start(name)
