"""The runtime inside a worker process: the integration surface of a training loop.

A loop runs under TrainMover with a few lines (see `trainmover.runtime.reference`)::

    with Runtime.from_env() as rt:
        role = rt.wait_for_role()            # a standby blocks here until a plan names it
        if role is None:
            return                           # released without ever being needed
        model, optimizer, data = build(role, group_of=lambda: rt.groups["tp"])
        rt.track(model, optimizer, stateful={"data": data}, generators={"dropout": gen})
        for step in rt.steps():              # boundaries: switches, transfer, holds, stop
            with rt.attempt():               # a failed step is discarded, not fatal
                loss = train_one_step(model, optimizer, data.next_batch(), rt.groups)
                rt.report(loss=loss)

`Runtime` answers the control API (`trainmover.runtime.control`) on a reader thread and
does everything that touches training at step boundaries, on the training thread:
phase 1 (prepare) only starts a background group builder, and phase 2 (commit) only
records the switch step; the switch itself, the state transfer and the exit of a leaver
happen in `steps()` between two steps.

Unplanned failures: every wait on a collective is bounded and abortable
(`trainmover.runtime.abort`), the optimizer step is gated by the per-step commit
agreement (`trainmover.runtime.agreement`), and a discarded step is rolled back (data
position, RNGs) so it re-executes with the same data after `recover`. A standby answers
`warm` with shadow iterations (`trainmover.runtime.shadow`) while it waits for a role.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from trainmover.runtime import checkpoint, fault, logs
from trainmover.runtime import control as c
from trainmover.runtime.abort import POLL_S, AbortSignal, CollectiveError, StepAborted
from trainmover.runtime.agreement import CommitAgreement
from trainmover.runtime.config import JobConfig, load_config
from trainmover.runtime.env import ENV_CONFIG, ENV_CONTROL, ENV_LOCAL_RANK, ENV_MACHINE, ENV_RUN_DIR
from trainmover.runtime.groups import (
    BuildAbandoned,
    Group,
    GroupBuilder,
    GroupTable,
    pick_device,
    retire,
)
from trainmover.runtime.layout import Role
from trainmover.runtime.plan import GroupSpec, Plan, RankRef
from trainmover.runtime.progress import Progress, ProgressBoard, StallWatch
from trainmover.runtime.records import open_record_store
from trainmover.runtime.sandbox import Recorder
from trainmover.runtime.shadow import ShadowFn, run_shadow
from trainmover.runtime.standard import StandardTorch
from trainmover.runtime.state import Stateful, TrainingState
from trainmover.runtime.steptime import WAITS, StepTimer

Part = Literal["leaver", "joiner", "stayer"]
RecoveryPart = Literal["joiner", "source", "stayer"]


class SupervisorGone(RuntimeError):
    """The control connection closed: nobody can coordinate this rank any more."""


class RecoverySuperseded(RuntimeError):
    """A newer recover plan replaced the one this rank was carrying out (another machine
    failed meanwhile); the rank drops what it built and starts the newer one."""


@dataclass
class _Migration:
    """This rank's view of the plan in flight."""

    plan: Plan
    part: Part
    builder: GroupBuilder
    prepared_at_step: int
    commit_step: int | None = None
    steps_during_build: int = 0


@dataclass
class _Recovery:
    """This rank's view of the recover plan in flight."""

    plan: Plan
    part: RecoveryPart


def _store_client(address: str, timeout_s: float) -> dist.TCPStore:
    if not address:
        raise RuntimeError("no rendezvous store known (a standby learns it when it joins)")
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
        self._extra_s = 0.0  # fault injection only (control `slow`)
        self._block_in = ""  # fault injection only (control `block`)
        self._timeout_s = config.runtime.group_timeout_s
        # Unplanned failures: the abort signal every wait checks, the commit vote, the
        # recover plan in flight, and the step in flight (None between steps).
        self.signal = AbortSignal("e0", config.runtime.failure_timeout_s)
        self.signal.on_failure = self._on_collective_failure
        self._agreement: CommitAgreement | None = None
        self._stalls: StallWatch | None = None  # names whoever holds a step back
        self._recovery: _Recovery | None = None
        self._superseded: set[str] = set()  # recover plans replaced by a newer one
        self._builders: list[GroupBuilder] = []
        self._recoveries = 0  # failures this process lived through (see `close`)
        self._in_flight: int | None = None
        self._voted = self._discarded = self._committed_in_flight = False
        self._warm_queue: list[c.Warm] = []
        self._warm_rounds = 0
        self._recorder: Recorder | None = None
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

    def wait_for_role(
        self, timeout_s: float | None = None, shadow: ShadowFn | None = None
    ) -> Role | None:
        """This rank's role; a standby blocks until a plan assigns one (None when the
        supervisor stopped it first). Meanwhile it answers `warm` requests by running
        `shadow` for each role type asked for, on this (the training) thread."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._cond:
                ok = self._cond.wait_for(
                    lambda: self.role is not None or self._stop or bool(self._warm_queue),
                    None if deadline is None else max(0.0, deadline - time.monotonic()),
                )
                if not ok:
                    raise TimeoutError("no role assigned")
                if self.role is not None or self._stop:
                    return self.role
                warm = self._warm_queue.pop(0)
            self._warm(warm, shadow)

    def _warm(self, warm: c.Warm, shadow: ShadowFn | None) -> None:
        self._warm_rounds += 1
        round_id = warm.round_id or f"{os.getppid()}-{self._warm_rounds}"
        try:
            if shadow is None:
                raise RuntimeError("this job gave wait_for_role no shadow step")
            warmed = run_shadow(
                self.me,
                self.config.layout,
                warm,
                shadow,
                self.records,
                self.run_dir / "sandbox" / self.me.machine,
                round_id,
                self._timeout_s,
                store_known=bool(self._store_address),
            )
        except Exception as exc:  # a failed warm-up leaves a usable (cold) standby
            self.log.exception("warm_failed")
            warmed = c.Warmed(
                role_types=[],
                iteration_s={},
                replayed=0,
                synthesized=0,
                local=0,
                store_known=bool(self._store_address),
                kept_bytes=0,
                rss_bytes=0,
                error=f"{type(exc).__name__}: {exc}",
            )
        self.log.info(
            "warmed",
            role_types=warmed.role_types,
            iteration_s=warmed.iteration_s,
            replayed=warmed.replayed,
            synthesized=warmed.synthesized,
        )
        self._conn.notify(warmed)

    def process_group(self, kind: str) -> dist.ProcessGroup:
        """The stable c10d group of `kind` ("tp", "pp", "dp") of this rank's role, for
        DDP, DeviceMesh.from_group or functional collectives (inside a shadow step: the
        sandbox's). `dist.init_process_group()` installs the default group likewise."""
        return self.torch.process_group(kind)

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
        self._state = TrainingState(model, optimizer, stateful or {}, generators or {})
        optimizer.register_step_pre_hook(self._before_optimizer_step)
        return self._state

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
            if not self._committed_in_flight:
                self._discarded = True
            self.log.warning("step_aborted", step=self._in_flight, error=str(exc)[:300])

    def report(self, loss: float | None = None) -> None:
        """Attaches the current step's loss to its step event."""
        self._loss = loss

    def steps(self) -> Iterator[int]:
        """Yields step numbers to train; returns when the job is finished or this rank
        left. Switches happen between two yields."""
        if self._state is None:
            raise RuntimeError("call track() before steps()")
        self._install_initial()
        joined = False
        if self._migration is not None and self._migration.part == "joiner":
            joined = self._join()  # False: a recovery took the migration's place
        if joined:
            pass
        elif self._recovery is not None and self._recovery.part == "joiner":
            self._recover_superseding(joiner=True)
        else:
            self._new_epoch(self.signal.epoch, self._state.step)
        while self._boundary(self._state.step):
            step = self._state.step + 1
            light = self._state.light()
            self._begin_step(step)
            timer = StepTimer()
            yield step
            if self._extra_s:
                time.sleep(self._extra_s)  # fault injection (control `slow`): extra compute
            if not (self._voted or self._discarded):
                try:  # a loop without an optimizer step still agrees on the step
                    self._vote(step)
                except StepAborted:
                    self._discarded = True
            measured = timer.stop()
            with self._cond:
                self._in_flight = None
            if self._discarded:
                self._state.restore_light(light)  # re-executed later with the same data
                self._state.optimizer.zero_grad(set_to_none=True)  # a partial accumulation
                self._end_recording(None)
                self._conn.notify(
                    c.StepAbortedEvent(
                        epoch=self.signal.epoch,
                        step=step,
                        last_committed=self._state.step,
                        reason=self.signal.reason or "aborted",
                        t=time.time(),
                    )
                )
                continue
            self._state.step = step
            if self._stalls is not None:
                self._stalls.step_done(measured.seconds)
            self._conn.notify(
                c.StepDone(
                    step=step,
                    t_end=time.time(),
                    seconds=measured.seconds,
                    loss=self._loss,
                    vote_s=self._agreement.last_vote_s if self._agreement else 0.0,
                    compute_s=measured.compute_s,
                    queued_s=measured.queued_s,
                )
            )
            self._loss = None
            self._end_recording(step)
            self._maybe_checkpoint(step)

    def _install_initial(self) -> None:
        """The generation-0 groups, once built: at the first step, or earlier when the
        loop's first c10d collective (a DDP constructor's) needs them."""
        if self._initial is not None:
            self.groups.install(self._initial.wait(self._timeout_s))
            self._initial = None

    # -- per step: commit agreement, recording, checkpoints -----------------------------

    def _begin_step(self, step: int) -> None:
        with self._cond:
            self._in_flight = step
            self._voted = self._discarded = self._committed_in_flight = False
        fault.at_step(step)
        if self._stalls is not None:
            self._stalls.board.progress.step = step
        if self._agreement is not None:
            self._agreement.begin(step)
        self._begin_recording(step)

    def _before_optimizer_step(self, *_: object) -> None:
        if self._in_flight is None or self._voted:
            return  # outside steps() (e.g. a shadow iteration), or already voted
        fault.point("after-allreduce")  # test-only: a machine dies before its vote
        if self._block_in:  # fault injection (control `block`): a deadlocked worker
            group, self._block_in = self.groups[self._block_in], ""
            group.allreduce(torch.zeros(1))
        self._vote(self._in_flight)

    def _vote(self, step: int) -> None:
        self._voted = True
        if self._stalls is not None:
            self._stalls.board.progress.voted = step
        if self._agreement is not None:
            with WAITS.waiting():  # waiting for the slowest voter is not computing
                self._agreement.vote(step)  # raises StepAborted: nothing is applied
        self._committed_in_flight = True

    def _begin_recording(self, step: int) -> None:
        """One live rank per role type records what it receives during `record_step`."""
        lay, role = self.config.layout, self.role
        if step != self.config.runtime.record_step or role is None or lay.pp == 1:
            return
        representative = lay.role_of_type(lay.role_type(role.pp), 0)
        if role == representative:  # replica 0, TP rank 0, first stage of its type
            self._recorder = Recorder()
            self.groups["pp"].tap = self._recorder.tap

    def _end_recording(self, committed: int | None) -> None:
        if self._recorder is None:
            return
        recorder, self._recorder = self._recorder, None
        self.groups["pp"].tap = None
        if committed is not None and self.role is not None:
            role_type = self.config.layout.role_type(self.role.pp)
            try:
                size = recorder.save(self.records, role_type)
            except Exception:  # standbys then synthesise; training must not stop for it
                self.log.exception("record_failed", role_type=role_type, step=committed)
                return
            self.log.info("recorded", role_type=role_type, bytes=size, step=committed)

    def _maybe_checkpoint(self, step: int) -> None:
        every = self.config.runtime.checkpoint_every
        if every and step % every == 0 and self._state is not None and self.role is not None:
            checkpoint.write(self.checkpoint_root, self.role, self._state)

    def _new_epoch(self, epoch: str, committed: int) -> None:
        """Starts vote epoch `epoch` with every rank at step `committed`."""
        self.signal.reset(epoch)
        if not self.config.runtime.commit_agreement:
            return
        if self._agreement is None:
            self._agreement = CommitAgreement(
                self._store_address,
                self.config.job,
                self.config.layout.machines * self.config.layout.tp,
                self.signal,
                committed,
                self.config.runtime.failure_timeout_s,
            )
            self._stalls = self._watch_stalls()
            if self.config.runtime.stall_detection:
                self._agreement.on_stall = self._stalls.stalled
                stalls = self._stalls
                # A rank blocked in a collective (nobody may have voted yet) asks too.
                self.signal.on_wait = lambda waited: stalls.stalled(
                    stalls.board.progress.epoch, stalls.board.progress.step, waited
                )
        self._agreement.reset(epoch, committed)
        assert self._stalls is not None
        self._stalls.board.progress = Progress(epoch=epoch, step=committed, voted=committed)

    def _watch_stalls(self) -> StallWatch:
        """This rank's entry on the progress board, and its judgement of held-back steps."""
        assert self.role is not None
        lay = self.config.layout
        board = ProgressBoard(
            self._store_address,
            self.config.job,
            lay.global_rank(self.role),
            lay.machines * lay.tp,
            self.me.machine,
            self.me.local_rank,
        )

        def report(stall: c.StallEvent) -> None:
            self.log.error("step_held_back", step=stall.step, reason=stall.reason)
            self._conn.notify(stall)

        rt = self.config.runtime
        return StallWatch(board, report, floor_s=rt.stall_floor_s, factor=rt.stall_factor)

    def _on_collective_failure(self, error: CollectiveError) -> None:
        """First failed collective of an epoch (training thread): report it, and abort
        the epoch for every rank through the store."""
        self.log.error(
            "collective_error", group=error.group, peer=error.peer_machine, error=error.error
        )
        self._conn.notify(
            c.CollectiveErrorEvent(
                epoch=self.signal.epoch,
                step=self._in_flight or 0,
                group=error.group,
                peer_machine=error.peer_machine,
                error=error.error,
                t=time.time(),
            )
        )
        if self._agreement is not None:
            self._agreement.abort(f"collective error in {error.group}")

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
        if self._agreement is not None:
            self._agreement.close()
        if self._stalls is not None:
            self._stalls.board.close()
        self.groups.shutdown()
        # Not waited for: a build abandoned in a rendezvous with a dead member ends only
        # at its timeout (a leaver whose first joiner died would hold its release, and
        # its machine's return to the pool, that long). The process ends without
        # interpreter teardown instead (below), where its return could not abort it.
        running = sum(1 for b in self._builders if b.discarded and not b.done)
        if running:
            self.log.info("abandoned_build_still_running", builds=running)
        troubled = sum(1 for b in self._builders if b.troubled)
        if troubled or self._recoveries:
            # Even once it ended, an abandoned or failed gloo rendezvous, or a group whose
            # peer died in a collective (repaired, then retired), can leave C++ threads
            # that interpreter teardown destroys joinable: the process then aborts
            # ("terminate called without an active exception", SIGABRT) after a clean
            # exit, and its supervisor reports a crash. Such a process ends without it.
            self.log.info(
                "exit_without_teardown", troubled_builds=troubled, recoveries=self._recoveries
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

    # -- step boundary -----------------------------------------------------------------

    def _boundary(self, step: int) -> bool:
        """Everything that happens between steps. True: train the next step."""
        while True:
            with self._cond:
                mig = self._migration
                if self._recovery is not None:
                    action = "recover"
                elif self.signal.is_set() and not self._stop:
                    # The epoch is aborted: no step may start before a recover plan.
                    self._cond.wait()
                    continue
                elif mig is not None and mig.commit_step == step:
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
            if action == "recover":
                self._recover_superseding(joiner=False)
                continue
            if action == "finish":
                if self._orphaned:
                    raise SupervisorGone("control connection closed")
                self._maybe_dump(step)
                return False
            if self._switch(step) == "left":
                return False

    def _maybe_dump(self, step: int) -> None:
        if self.config.train.dumps_at(step) and self._state and self.role:
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
            stats = self._state.send(transfer, peer=1, extra={"epoch": self.signal.epoch})
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
        retire(self.groups.install(built))
        self.torch.installed([g.spec.kind for g in built])
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

    def _join(self) -> bool:
        """A joiner's phase 2: wait for the commit, receive the leaver's state, install
        its new groups; training then continues from the leaver's step. False when a
        recovery superseded the migration before its commit (its leaver failed)."""
        mig = self._migration
        assert mig is not None and self._state is not None
        with self._cond:
            self._cond.wait_for(
                lambda: mig.commit_step is not None or self._stop or self._recovery is not None
            )
            if self._recovery is not None and mig.commit_step is None:
                return False
            if mig.commit_step is None:
                raise SupervisorGone("stopped before the commit")
        t_start = time.time()
        built = mig.builder.wait(self._timeout_s)
        transfer = self._transfer_group(built)
        stats = self._state.receive(transfer, peer=0)
        built.remove(transfer)
        retire([transfer])
        del transfer
        if self._state.step != mig.commit_step:
            raise RuntimeError(f"leaver sent step {self._state.step}, commit was {mig.commit_step}")
        role_groups = [g for g in built if g.spec.kind != "transfer"]
        self.groups.install(role_groups)
        self.torch.installed([g.spec.kind for g in role_groups])
        self._new_epoch(str(stats.extra.get("epoch", "e0")), self._state.step)
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
        return True

    def _recover_superseding(self, joiner: bool) -> None:
        """Carries out the recover plan in flight; when a newer plan supersedes it midway
        (another machine failed), starts over with that one."""
        while self._recovery is not None:
            try:
                self._recover(joiner)
            except RecoverySuperseded as exc:
                self.log.warning("recovery_superseded", error=str(exc))

    def _recover(self, joiner: bool) -> None:
        """The unplanned path at a boundary (every rank of the job, and the joiner before
        its first step): every rank is at its last committed step (the in-flight step was
        discarded); rebuild the delta and every dirty group; restore the joiner from its
        state source, or every rank from the last common checkpoint; start a new epoch."""
        rec = self._recovery
        assert rec is not None and self._state is not None and self.role is not None
        plan, t_start = rec.plan, time.time()
        self._recoveries += 1

        def superseded() -> bool:
            return self._recovery is not rec

        # The new epoch starts now: the recovery's own collectives must not see the old
        # epoch's abort (and a late abort of the old epoch can no longer reach them).
        self.signal.reset(plan.plan_id)
        store = _store_client(self._store_address, self._timeout_s)
        prefix = f"{self.config.job}/recover/{plan.plan_id}/"
        specs = plan.specs_for(self.me)
        repaired = [] if joiner else self._dirty_groups(plan, store, prefix, superseded)
        specs = sorted([*specs, *repaired], key=lambda s: s.name)
        try:
            built = self._builder(specs, f"recover-{plan.plan_id}").wait(
                self._timeout_s, abandon=superseded
            )
        except BuildAbandoned as exc:
            raise RecoverySuperseded(f"{plan.plan_id}: {exc}") from None
        build_s = time.time() - t_start
        transfer_bytes, transfer_s = 0, 0.0
        pairs = [g for g in built if g.spec.kind == "transfer"]
        built = [g for g in built if g.spec.kind != "transfer"]
        if plan.restore == "checkpoint":
            roles = [
                r for cell in self.config.layout.cells() for r in self.config.layout.roles_of(cell)
            ]
            step = checkpoint.agree_step(
                store, prefix, self.role, roles, self.checkpoint_root, self._timeout_s
            )
            checkpoint.load(self.checkpoint_root, self.role, step, self._state)
            source: Literal["replica", "checkpoint"] = "checkpoint"
        else:
            source = "replica"
            for i in range(len(pairs)):
                stats = (
                    self._state.receive(pairs[i], peer=0)
                    if joiner
                    else self._state.send(pairs[i], peer=1, extra={"epoch": plan.plan_id})
                )
                transfer_bytes += stats.bytes
                transfer_s += stats.seconds
        # Shutting down never blocks, even with an abandoned work in a replaced group.
        retire(self.groups.install(built))
        self.torch.installed([g.spec.kind for g in built])
        retire(pairs)
        self._new_epoch(plan.plan_id, self._state.step)
        with self._cond:
            if self._recovery is rec:  # else a newer plan arrived: the boundary runs it
                self._recovery = None
        event = c.Switched(
            plan_id=plan.plan_id,
            step=self._state.step,
            part=rec.part,
            rebuilt=sorted(s.name for s in specs if s.kind != "transfer" and not s.repair),
            repaired=sorted(s.name for s in repaired),
            t_start=t_start,
            t_end=time.time(),
            transfer_bytes=transfer_bytes,
            transfer_s=transfer_s,
            source=source,
            build_s=build_s,
            digest=self._state.digest(),
        )
        self.log.info(
            "recovered",
            plan_id=plan.plan_id,
            part=rec.part,
            step=event.step,
            source=source,
            rebuilt=event.rebuilt,
            repaired=event.repaired,
            seconds=round(event.t_end - t_start, 4),
        )
        self._conn.notify(event)

    def _dirty_groups(
        self,
        plan: Plan,
        store: dist.TCPStore,
        prefix: str,
        superseded: Callable[[], bool],
    ) -> list[GroupSpec]:
        """Groups outside the delta that some member left dirty (an abandoned work), as
        repair specs. Every survivor publishes its own dirty groups, then reads those of
        its groups' members, so all members of a group decide the same."""
        mine = sorted(g.name for g in self.groups.values() if g.dirty)
        store.set(f"{prefix}dirty/{self.me}", json.dumps(mine))
        delta = {s.name for s in plan.groups}
        repairs = []
        for group in self.groups.values():
            if group.name in delta:
                continue
            keys = [f"{prefix}dirty/{m}" for m in group.spec.members]
            self._wait_keys(store, keys, superseded)
            if any(group.name in json.loads(store.get(k)) for k in keys):
                repairs.append(group.spec.model_copy(update={"repair": plan.plan_id}))
        return repairs

    def _wait_keys(
        self, store: dist.TCPStore, keys: list[str], superseded: Callable[[], bool]
    ) -> None:
        """Until every key is in the store; a member that failed never writes its key, so
        a newer recover plan (which leaves it out) ends the wait. The store has no way to
        wake us, so it is polled between waits on our own condition."""
        deadline = time.monotonic() + self._timeout_s
        while not store.check(keys):
            with self._cond:
                if superseded():
                    raise RecoverySuperseded(f"stopped waiting for {keys}")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"store keys {keys} not set in {self._timeout_s}s")
                self._cond.wait(POLL_S)

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
            if msg.store:
                self._store_address = msg.store
            return self._prepare(msg.plan)
        if isinstance(msg, c.Commit):
            return self._commit(msg.plan_id, msg.step)
        if isinstance(msg, c.Recover):
            return self._recover_request(msg)
        if isinstance(msg, c.Abort):
            if self._agreement is None:  # a standby: nothing in flight
                return c.AbortAck(aborted=False, epoch=self.signal.epoch)
            done = self._agreement.abort(msg.reason or "aborted by the supervisor", msg.epoch)
            return c.AbortAck(aborted=done, epoch=self.signal.epoch)
        with self._cond:
            if isinstance(msg, c.Warm):
                if self.role is not None:
                    raise ValueError("warm: this rank already has a role")
                self._warm_queue.append(msg)
                self._cond.notify_all()
                return c.Ack()
            if isinstance(msg, c.Advance):
                self._limit = msg.limit
            elif isinstance(msg, c.Stop):
                self._stop = True
            elif isinstance(msg, c.Slow):
                self._extra_s = msg.extra_s
            elif isinstance(msg, c.Block):
                if self.groups.get(msg.group) is None:
                    raise ValueError(f"block: this rank has no group {msg.group!r}")
                self._block_in = msg.group
            elif isinstance(msg, c.Status):
                return c.RankStatus(
                    machine=self.me.machine,
                    local_rank=self.me.local_rank,
                    role=self.role,
                    step=self._state.step if self._state else 0,
                    limit=self._limit,
                    groups=self.groups.snapshot(),
                    plan_id=self._migration.plan.plan_id if self._migration else None,
                    last_committed=self._state.step if self._state else 0,
                    epoch=self.signal.epoch,
                    aborted=self.signal.is_set(),
                    digest=self._state.digest() if msg.digest and self._state else "",
                )
            else:
                raise ValueError(f"unexpected request {msg.TYPE}")
            self._cond.notify_all()
        return c.Ack()

    def _recover_request(self, msg: c.Recover) -> c.RecoverAck:
        """Records the recover plan for the next boundary and aborts the current epoch
        (if no rank has yet), which gets this rank out of a step blocked on the dead
        machine."""
        plan = msg.plan
        part: RecoveryPart
        if self.me.machine in plan.joiners():
            part = "joiner"
        elif self.me.machine in plan.sources():
            part = "source"
        else:
            part = "stayer"
        with self._cond:
            if plan.plan_id in self._superseded:  # a late retry of a replaced plan
                raise ValueError(f"recover: plan {plan.plan_id} was superseded")
            if self._recovery is not None:
                if self._recovery.plan.plan_id == plan.plan_id:  # idempotent retry
                    return c.RecoverAck(part=part, committed=self._committed())
                if self._recovery.plan.plan_id not in plan.supersedes:
                    raise RuntimeError(f"recovery {self._recovery.plan.plan_id} still in flight")
            if msg.store:
                self._store_address = msg.store
            if part == "joiner":
                move = plan.move_of(self.me.machine)
                assert move is not None
                role = move.roles[self.me.local_rank]
                if self.role is None:
                    self._take_role(role)
                elif self.role != role:
                    # The same role is fine: a joiner kept by the plan that superseded hers.
                    raise ValueError("recover: the joiner already has another role")
            elif self.role is None:
                raise ValueError("recover: a standby that is not the plan's joiner")
            # A planned migration caught by the failure is superseded by this plan; its
            # phase-1 groups are never installed.
            if self._migration is not None:
                self._migration.builder.discard()
            self._migration = None
            self._superseded.update(plan.supersedes)
            self._recovery = _Recovery(plan, part)
            self._cond.notify_all()
        if part != "joiner" and self._agreement is not None:
            self._agreement.abort(f"recover {plan.plan_id}")
        self.log.info("recover", plan_id=plan.plan_id, part=part, committed=self._committed())
        return c.RecoverAck(part=part, committed=self._committed() if part != "joiner" else -1)

    def _committed(self) -> int:
        return self._state.step if self._state is not None else 0

    def _prepare(self, plan: Plan) -> c.PrepareAck:
        """Phase 1: start building my groups of the delta in the background."""
        with self._cond:
            if self._migration is not None:
                old = self._migration
                if old.plan.plan_id == plan.plan_id:  # idempotent retry
                    return c.PrepareAck(
                        step=self._passed, building=[s.name for s in old.builder.specs]
                    )
                overlap = {g.name for g in old.plan.groups} & {g.name for g in plan.groups}
                if old.commit_step is not None or old.part == "joiner" or not overlap:
                    raise RuntimeError(f"plan {old.plan.plan_id} still in flight")
                # The planner never has two plans rebuilding one group: a newer plan for
                # these groups means the old one ended in phase 1 (failed or withdrawn)
                # and nobody will commit it. Its groups are never installed.
                self.log.warning("plan_replaced", plan_id=old.plan.plan_id, by=plan.plan_id)
                old.builder.discard()
                self._migration = None
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
        """A stayer only moves its groups forward: a stale or replayed plan is refused
        here, before anything is built. Generations may be skipped (those of a plan that
        ended in phase 1 stay claimed: their store prefixes are never reused)."""
        if part != "stayer":
            return
        for spec in specs:
            current = self.groups.get(spec.kind)
            if current is not None and spec.generation <= current.generation:
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
        self.torch.take_role(role, self._store_address)
        self.log = self.log.bind(role=role.key, rank=self.config.layout.global_rank(role))

    def _builder(self, specs: list[GroupSpec], name: str) -> GroupBuilder:
        # A store connection of its own: the builder thread must not share a client
        # with anything else running meanwhile.
        store = _store_client(self._store_address, self._timeout_s)
        builder = GroupBuilder(
            specs, self.me, store, self.config.job, self.device, self._timeout_s, self.signal
        )
        # A troubled build is kept to the end: `close` decides how the process exits.
        self._builders = [b for b in self._builders if b.troubled] + [builder]
        return builder.start(name)


def _end_without_teardown(code: int) -> None:
    """atexit: ends the process here, its output flushed, before interpreter teardown
    (see `Runtime.close`)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
