"""The runtime inside a worker process: the integration surface of a training loop.

A loop runs under TrainMover with a few lines (see `trainmover.runtime.reference`)::

    with Runtime.from_env() as rt:
        role = rt.wait_for_role()            # a standby blocks here until a plan names it
        if role is None:
            return                           # released without ever being needed
        model, optimizer, data = build(role, group_of=lambda: rt.process_group("tp"))
        rt.track(model, optimizer, stateful={"data": data}, generators={"dropout": gen})
        for step in rt.steps():              # boundaries: switches, transfer, holds, stop
            with rt.attempt():               # a failed step is discarded, not fatal
                loss = train_one_step(model, optimizer, data.next_batch(), rt.process_group)
                rt.report(loss=loss)

`Runtime` is the front: what the user calls, the step loop, and the dispatch of control
requests (`trainmover.runtime.control`, answered on a reader thread). Behind it:

- `trainmover.runtime.acceptance`: which requests are accepted or refused (pure);
- `trainmover.runtime.planned`: a planned migration, phase 1 to the switch, in order;
- `trainmover.runtime.recovery`: a failure's recover plan, in order;
- `trainmover.runtime.epochs`: the step in flight and its commit vote
  (`trainmover.runtime.agreement`); every wait on a collective is bounded and
  abortable (`trainmover.runtime.abort`), and a discarded step is rolled back (data
  position, RNGs) so it re-executes with the same data after `recover`;
- `trainmover.runtime.core`: what they share.

Everything that touches training happens on the training thread at step boundaries,
between two yields of `steps()`. A standby answers `warm` with shadow iterations
(`trainmover.runtime.shadow`) while it waits for a role.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import structlog
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainmover.runtime import checkpoint, controlconn, dumps, fault, logs
from trainmover.runtime import control as c
from trainmover.runtime.abort import AbortSignal, StepAborted
from trainmover.runtime.acceptance import Acceptance
from trainmover.runtime.build import GroupBuilder, pick_device
from trainmover.runtime.config import JobConfig, load_config
from trainmover.runtime.core import Core, SupervisorGone
from trainmover.runtime.env import ENV_CONFIG, ENV_CONTROL, ENV_LOCAL_RANK, ENV_MACHINE, ENV_RUN_DIR
from trainmover.runtime.epochs import VoteEpochs
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Role
from trainmover.runtime.plan import RankRef
from trainmover.runtime.planned import PlannedSwitch
from trainmover.runtime.records import open_record_store
from trainmover.runtime.recovery import FailureRecovery
from trainmover.runtime.sandbox import LiveRecording
from trainmover.runtime.shadow import ShadowFn, warm_up
from trainmover.runtime.standard import StandardTorch
from trainmover.runtime.state import Stateful, TrainingState
from trainmover.runtime.steptime import StepTimer


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
        self._initial: GroupBuilder | None = None
        self._orphaned = False
        self._exit_reason: Literal["finished", "left", "error"] = "finished"
        self._loss: float | None = None
        self._extra_s = 0.0  # fault injection only (control `slow`)
        self._warm_queue: list[c.Warm] = []
        self._warm_rounds = 0
        #: The abort signal every wait on a collective checks, scoped by vote epoch.
        self.signal = AbortSignal("e0", config.runtime.failure_timeout_s)
        self.records = open_record_store(config, run_dir, f"worker.{machine}.{local_rank}")
        #: c10d groups, torchrun's environment and DDP (`trainmover.runtime.standard`).
        self.torch = StandardTorch(config.layout, self.groups, self._install_initial)
        self.checkpoint_root = (
            Path(config.runtime.checkpoint_dir)
            if config.runtime.checkpoint_dir
            else run_dir / "checkpoints"
        )
        fault.arm(machine)

        torch.set_num_threads(config.runtime.threads)
        logs.configure()
        self._core = Core(
            me=self.me,
            config=config,
            run_dir=run_dir,
            device=self.device,
            groups=self.groups,
            torch=self.torch,
            signal=self.signal,
            records=self.records,
            # Bound, not contextvars: other threads log too and do not inherit those.
            log=logs.get_logger(
                job=config.job, machine=machine, local_rank=local_rank, pid=os.getpid()
            ),
            accepted=Acceptance(self.me, total_steps=config.train.steps),
            checkpoint_root=self.checkpoint_root,
        )
        self._cond = self._core.cond
        self._votes = VoteEpochs(self._core)
        self._planned = PlannedSwitch(self._core, self._votes.new_epoch, self._votes.leave)
        self._recovery = FailureRecovery(self._core, self._votes.new_epoch, self._votes.abort)
        self.torch.new_world = self._votes.new_world
        self._conn = self._core.conn = controlconn.Connection(
            controlconn.connect(control_address),
            on_request=self._on_request,
            on_close=self._on_close,
        ).start()
        hello = c.Hello(
            machine=machine,
            local_rank=local_rank,
            pid=os.getpid(),
            machine_store=self._votes.serve_machine(),
        )
        welcome = self._conn.request(hello, self._timeout_s)
        assert isinstance(welcome, c.Welcome)
        with self._cond:
            self._core.store_address, self._core.machine_store = (
                welcome.store,
                welcome.machine_store,
            )
            self._votes.set_up_machine()
            self._core.accepted.limit = welcome.limit
            self._standby = welcome.role is None  # its state will come from a peer
            if welcome.role is not None:
                self._core.take_role(welcome.role)
                # Generation-0 groups build in the background while the user builds it.
                self._initial = self._core.builder(welcome.groups, "initial-groups")
        self.log.info(
            "welcome",
            role=welcome.role and welcome.role.key,
            limit=welcome.limit,
            launch=welcome.launch,
            machine_store=welcome.machine_store,
        )

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

    @property
    def role(self) -> Role | None:
        """This rank's role (None for a standby not yet named by a plan)."""
        return self._core.accepted.role

    @property
    def log(self) -> structlog.stdlib.BoundLogger:
        """This rank's logger, bound to its job, machine and (once it has one) role."""
        return self._core.log

    @property
    def _state(self) -> TrainingState | None:
        return self._core.state

    @property
    def _timeout_s(self) -> float:
        return self._core.timeout_s

    # -- integration surface -----------------------------------------------------------

    def wait_for_role(
        self, timeout_s: float | None = None, shadow: ShadowFn | None = None
    ) -> Role | None:
        """This rank's role; a standby blocks until a plan assigns one (None when the
        supervisor stopped it first). Meanwhile it answers `warm` requests by running
        `shadow` for each role type asked for, on this (the training) thread."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        accepted = self._core.accepted
        while True:
            with self._cond:
                ok = self._cond.wait_for(
                    lambda: accepted.role is not None or accepted.stopped or bool(self._warm_queue),
                    None if deadline is None else max(0.0, deadline - time.monotonic()),
                )
                if not ok:
                    raise TimeoutError("no role assigned")
                if accepted.role is not None or accepted.stopped:
                    return accepted.role
                warm = self._warm_queue.pop(0)
            self._warm(warm, shadow)

    def _warm(self, warm: c.Warm, shadow: ShadowFn | None) -> None:
        self._warm_rounds += 1
        warmed = warm_up(
            self.me,
            self.config.layout,
            warm,
            shadow,
            self.records,
            self.run_dir / "sandbox" / self.me.machine,
            warm.round_id or f"{os.getppid()}-{self._warm_rounds}",
            self._timeout_s,
            store_known=bool(self._core.store_address),
            log=self.log,
            records_wait_s=self._timeout_s if self.config.runtime.record_step else 0.0,
        )
        self._conn.notify(warmed)

    def process_group(self, kind: str) -> dist.ProcessGroup:
        """The stable c10d group of `kind` ("tp", "pp", "dp") of this rank's role, for
        DDP, DeviceMesh.from_group or functional collectives (inside a shadow step: the
        sandbox's). `dist.init_process_group()` installs the default group likewise."""
        return self.torch.process_group(kind)

    def device_mesh(self) -> DeviceMesh:
        """The job layout's `DeviceMesh` over this role's groups (FSDP2, DTensor):
        `trainmover.runtime.pgs.ProcessGroups.device_mesh`."""
        return self.torch.device_mesh(self.device.type)

    def track(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        stateful: dict[str, Stateful] | None = None,
        generators: dict[str, torch.Generator] | None = None,
    ) -> TrainingState:
        """Registers what a leaver sends its joiner (besides torch's global RNG), and
        gates `optimizer.step()` with the commit agreement (a step pre-hook)."""
        self.torch.track(model)
        state = TrainingState(model, optimizer, stateful or {}, generators or {})
        if self._standby:
            state.prime()  # before the vote's hook: priming steps the optimizer
        self._core.state = state
        self._core.tracked.set()
        optimizer.register_step_pre_hook(self._votes.before_optimizer_step)
        return state

    @contextmanager
    def attempt(self) -> Iterator[None]:
        """Wraps one step's body: a step that a failure aborted (StepAborted, from any
        collective or the vote) is discarded and rolled back instead of ending the
        process; `steps()` then waits for `recover` and re-executes it."""
        try:
            yield
        except (StepAborted, RuntimeError) as exc:
            # A collective failed inside DDP's reducer (or another library) surfaces as
            # its own RuntimeError: the c10d group's failed work tells it from a bug.
            if not isinstance(exc, StepAborted) and not (
                self.torch.c10d_failed() or self.signal.is_set()
            ):
                raise
            if not self._votes.committed_in_flight:
                self._votes.discarded = True
            self.log.warning("step_aborted", step=self._votes.in_flight, error=str(exc)[:300])

    def report(self, loss: float | None = None) -> None:
        """Attaches the current step's loss to its step event."""
        self._loss = loss

    def steps(self) -> Iterator[int]:
        """Yields step numbers to train; returns when the job is finished or this rank
        left. Switches happen between two yields."""
        state = self._state
        if state is None:
            raise RuntimeError("call track() before steps()")
        self._install_initial()
        accepted, votes = self._core.accepted, self._votes
        recording = LiveRecording(self.config.layout, self.config.runtime.record_step, self.records)
        joiner = accepted.planned is not None and accepted.planned.part == "joiner"
        if joiner and self._planned.join():  # False: a recovery took the migration's place
            pass
        elif accepted.recovering is not None and accepted.recovering.part == "joiner":
            self._recovery.carry_out(joiner=True)
        else:
            votes.new_epoch(self.signal.epoch, state.step)
        while self._boundary(state.step):
            step = state.step + 1
            light = state.light()
            votes.begin(step)
            recording.begin(step, self.role, self.groups)
            timer = StepTimer()
            yield step
            if self._extra_s:
                time.sleep(self._extra_s)  # fault injection (control `slow`): extra compute
            votes.vote_unless_done(step)
            measured = timer.stop()
            votes.end()
            if votes.discarded:
                state.restore_light(light)  # re-executed later with the same data
                self.torch.discard_step(state.model)
                state.optimizer.zero_grad(set_to_none=True)  # a partial accumulation
                recording.end(None, self.role, self.groups, self.log)
                self._conn.notify(
                    c.StepAbortedEvent(
                        epoch=self.signal.epoch,
                        step=step,
                        last_committed=state.step,
                        reason=self.signal.reason or "aborted",
                        t=time.time(),
                    )
                )
                continue
            state.step = step
            votes.committed(measured.seconds)
            self._conn.notify(
                c.StepDone(
                    step=step,
                    t_end=time.time(),
                    seconds=measured.seconds,
                    loss=self._loss,
                    vote_s=votes.last_vote_s,
                    compute_s=measured.compute_s,
                    queued_s=measured.queued_s,
                )
            )
            self._loss = None
            recording.end(step, self.role, self.groups, self.log)
            self._maybe_checkpoint(step)

    def _install_initial(self) -> None:
        """The generation-0 groups, once built: at the first step or first c10d collective."""
        if self._initial is not None:
            self.groups.install(self._initial.wait(self._timeout_s))
            self._initial = None

    # -- step boundary -----------------------------------------------------------------

    def _boundary(self, step: int) -> bool:
        """Everything that happens between steps. True: train the next step."""
        accepted = self._core.accepted
        while True:
            with self._cond:
                # Checked and recorded under one lock: a commit for this step can no
                # longer be accepted once the rank is past it.
                action = accepted.at_boundary(step, aborted=self.signal.is_set())
                if action == "wait":
                    self._cond.wait()
                    continue
            if action == "train":
                dumps.maybe_dump(self._core, step)
                fault.point("after-dump")  # test-only: a machine dies after its dump
                return True
            if action == "recover":
                self._recovery.carry_out(joiner=False)
                continue
            if action == "finish":
                if self._orphaned:
                    raise SupervisorGone("control connection closed")
                dumps.maybe_dump(self._core, step, last=step == accepted.total_steps)
                return False
            if self._planned.switch(step) == "left":
                self._exit_reason = "left"
                return False

    # -- per step: checkpoints ---------------------------------------------------------

    def _maybe_checkpoint(self, step: int) -> None:
        every = self.config.runtime.checkpoint_every
        if every and step % every == 0 and self._state is not None and self.role is not None:
            checkpoint.write(self.checkpoint_root, self.role, self._state)

    # -- exit --------------------------------------------------------------------------

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
        self._votes.close()
        self._recovery.close()
        self.groups.shutdown()
        # Not waited for: a build abandoned in a rendezvous with a dead member ends only at
        # its timeout, holding a leaver's release that long; the process ends without
        # interpreter teardown instead (below), where its return cannot abort it.
        builders = self._core.builders
        running = sum(1 for b in builders if b.discarded and not b.done)
        if running:
            self.log.info("abandoned_build_still_running", builds=running)
        troubled = sum(1 for b in builders if b.troubled)
        if troubled or self._recovery.count:
            # An abandoned or failed gloo rendezvous, or a group whose peer died in a
            # collective, can leave C++ threads that interpreter teardown destroys
            # joinable: SIGABRT after a clean exit, reported as a crash. Skip teardown.
            self.log.info(
                "exit_without_teardown", troubled_builds=troubled, recoveries=self._recovery.count
            )
            atexit.register(_end_without_teardown, 1 if reason == "error" else 0)
        self.records.close()
        self.torch.close()
        step = self._state.step if self._state else 0
        self.log.info("exit", reason=reason, step=step, error=error or None)
        if not self._conn.closed.is_set():
            try:
                self._conn.notify(c.Exited(reason=reason, step=step, error=error))
            except OSError:
                pass
        self._conn.close()

    # -- control API (reader thread) ---------------------------------------------------

    def _on_request(self, msg: c.Message) -> c.Message:
        if isinstance(msg, c.Prepare):
            return self._planned.prepare(msg)
        if isinstance(msg, c.Commit):
            return self._planned.commit(msg)
        if isinstance(msg, c.Recover):
            return self._recovery.request(msg)
        if isinstance(msg, c.Abort):
            done = self._votes.abort(msg.reason or "aborted by the supervisor", msg.epoch)
            return c.AbortAck(aborted=done, epoch=self.signal.epoch)
        accepted = self._core.accepted
        with self._cond:
            if isinstance(msg, c.Warm):
                if accepted.role is not None:
                    raise ValueError("warm: this rank already has a role")
                self._warm_queue.append(msg)
                self._cond.notify_all()
                return c.Ack()
            if isinstance(msg, c.Advance):
                if msg.last and accepted.passed >= msg.limit:
                    raise ValueError(
                        f"last step {msg.limit}: already past it (at step {accepted.passed + 1})"
                    )
                accepted.limit = msg.limit
                if msg.last:  # brought forward, never put back
                    accepted.total_steps = min(accepted.total_steps, msg.limit)
            elif isinstance(msg, c.Stop):
                accepted.stopped = True
            elif isinstance(msg, c.Slow):
                self._extra_s = msg.extra_s
            elif isinstance(msg, c.Block):
                if self.groups.get(msg.group) is None:
                    raise ValueError(f"block: this rank has no group {msg.group!r}")
                self._votes.block_in = msg.group
            elif isinstance(msg, c.Status):
                return c.RankStatus(
                    machine=self.me.machine,
                    local_rank=self.me.local_rank,
                    role=accepted.role,
                    step=self._core.committed,
                    limit=accepted.limit,
                    groups=self.groups.snapshot(),
                    plan_id=accepted.planned.plan.plan_id if accepted.planned else None,
                    last_committed=self._core.committed,
                    epoch=self.signal.epoch,
                    aborted=self.signal.is_set(),
                    digest=self._state.digest() if msg.digest and self._state else "",
                    passed=accepted.passed,
                )
            else:
                raise ValueError(f"unexpected request {msg.TYPE}")
            self._cond.notify_all()
        return c.Ack()

    def _on_close(self) -> None:
        with self._cond:
            self._core.accepted.stopped = self._orphaned = True
            self._cond.notify_all()


def _end_without_teardown(code: int) -> None:
    """atexit: ends the process, output flushed, before interpreter teardown (`close`)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
