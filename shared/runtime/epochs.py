"""The step in flight and its commit vote, epoch by epoch, for one rank.

Every step is voted on before its optimizer step applies (`trainmover.runtime.agreement`,
through an optimizer step pre-hook); a vote epoch begins with every rank at one committed
step and ends when some rank aborts it (a failed collective, a recover plan, the
supervisor). The progress board (`trainmover.runtime.progress`) names whoever holds a
step back. A step that the abort reached before its vote is discarded, and re-executed
after the recovery. The lazily built world group of a TP/PP layout is keyed by the same
(epoch, step) (`new_world`).
"""

from __future__ import annotations

import threading
import time

import torch

from trainmover.runtime import control as c
from trainmover.runtime import fault
from trainmover.runtime.abort import CollectiveError, StepAborted
from trainmover.runtime.agreement import CommitAgreement
from trainmover.runtime.core import Core
from trainmover.runtime.layout import Role
from trainmover.runtime.machinevote import MachineStore, MachineTally
from trainmover.runtime.progress import Progress, ProgressBoard, StallWatch
from trainmover.runtime.steptime import WAITS
from trainmover.runtime.world import LazyWorld


class VoteEpochs:
    """One rank's step in flight, its vote, and the epochs they belong to."""

    def __init__(self, core: Core):
        self.core = core
        self.agreement: CommitAgreement | None = None
        #: This rank's share of its machine's store (the vote, the progress board).
        self.machine: MachineTally | None = None
        self.stalls: StallWatch | None = None  # names whoever holds a step back
        self.in_flight: int | None = None  # None between steps
        self.voted = self.discarded = self.committed_in_flight = False
        self.block_in = ""  # fault injection only (control `block`)
        core.signal.on_failure = self._on_collective_failure
        #: The machine's vote store, served by local rank 0 from its start (`serve_machine`).
        self._server: MachineStore | None = None
        #: Sets up the machine's share of the vote from the welcome on (a standby's while
        #: it waits), so that the connections it opens are never on a switch's path.
        self._machine_ahead: threading.Thread | None = None

    def serve_machine(self) -> str:
        """Local rank 0 of a machine with several voting ranks: serves their vote store,
        before its hello names it (`trainmover.runtime.machinevote`); its address, or ""."""
        core = self.core
        if (
            core.me.local_rank != 0
            or core.config.layout.ranks_per_machine == 1
            or not core.config.runtime.commit_agreement
        ):
            return ""
        self._server = MachineStore()
        return self._server.address

    def set_up_machine(self) -> None:
        """Starts setting up this rank's share of its machine's vote store, as named in
        its welcome (`core.machine_store`), in the background; `new_epoch` waits for it."""
        core = self.core
        if not core.machine_store or not core.config.runtime.commit_agreement:
            return

        def set_up() -> None:
            try:
                self.machine = self._machine_tally()
            except RuntimeError as err:  # `new_epoch` tries again, on its own path
                core.log.warning("machine_tally_ahead_failed", error=str(err))

        self._machine_ahead = threading.Thread(target=set_up, name="tally-ahead", daemon=True)
        self._machine_ahead.start()

    def new_world(self, role: Role) -> LazyWorld:
        """The world group of a TP/PP layout (`trainmover.runtime.world`); its slot is the
        (vote epoch, step) a collective belongs to, the step about to start between two."""
        core = self.core

        def slot() -> str:
            step = self.in_flight if self.in_flight is not None else core.committed + 1
            return f"{core.signal.epoch}/{step}"

        return LazyWorld(
            core.me,
            core.config.job,
            core.config.layout.global_rank(role),
            core.config.layout.world_size,
            slot=slot,
            store=core.store,
            build=core.builder,
            signal=core.signal,
            timeout_s=core.timeout_s,
            log=lambda: core.log,
        )

    def new_epoch(self, epoch: str, committed: int) -> None:
        """Starts vote epoch `epoch` with every rank at step `committed`."""
        core = self.core
        core.signal.reset(epoch)
        if not core.config.runtime.commit_agreement:
            return
        if self.agreement is None:
            lay, role = core.config.layout, core.accepted.role
            assert role is not None
            if self._machine_ahead is not None:
                self._machine_ahead.join()
            if self.machine is None:
                self.machine = self._machine_tally()
            self.agreement = CommitAgreement(
                core.store_address,
                core.config.job,
                lay.world_size,
                core.signal,
                committed,
                core.config.runtime.failure_timeout_s,
                machine=self.machine,
                rank=lay.global_rank(role),
            )
            self.agreement.share.on_move.append(
                lambda generation, incarnation: core.log.warning(
                    "store_moved", incarnation=incarnation, generation=generation
                )
            )
            self.stalls = self._watch_stalls()
            if core.config.runtime.stall_detection:
                self.agreement.on_stall = self.stalls.stalled
                stalls = self.stalls
                # A rank blocked in a collective (nobody may have voted yet) asks too.
                core.signal.on_wait = lambda waited: stalls.stalled(
                    stalls.board.progress.epoch, stalls.board.progress.step, waited
                )
        self.agreement.reset(epoch, committed)
        assert self.stalls is not None
        self.stalls.board.progress = Progress(epoch=epoch, step=committed, voted=committed)

    def _machine_tally(self) -> MachineTally | None:
        """This rank's share of its machine's vote store, where its welcome named one
        (a machine with several ranks)."""
        core = self.core
        if not core.machine_store:
            return None
        return MachineTally(
            core.machine_store,
            core.me.local_rank,
            core.config.layout.ranks_per_machine,
            core.config.runtime.failure_timeout_s,
            server=self._server,
        )

    def _watch_stalls(self) -> StallWatch:
        """This rank's entry on the progress board, and its judgement of held-back steps."""
        core = self.core
        role, lay = core.accepted.role, core.config.layout
        assert role is not None
        board = ProgressBoard(
            core.store_address,
            core.config.job,
            lay.global_rank(role),
            lay.world_size,
            core.me.machine,
            core.me.local_rank,
            machine_store=self.machine.address if self.machine is not None else None,
            local_world=lay.ranks_per_machine,
        )

        def report(stall: c.StallEvent) -> None:
            core.log.error("step_held_back", step=stall.step, reason=stall.reason)
            core.conn.notify(stall)

        rt = core.config.runtime
        return StallWatch(board, report, floor_s=rt.stall_floor_s, factor=rt.stall_factor)

    def begin(self, step: int) -> None:
        with self.core.cond:
            self.in_flight = step
            self.voted = self.discarded = self.committed_in_flight = False
        fault.at_step(step)
        if self.stalls is not None:
            self.stalls.board.progress.step = step
        if self.agreement is not None:
            self.agreement.begin(step)

    def before_optimizer_step(self, *_: object) -> None:
        """The optimizer's step pre-hook: the step applies only once every rank voted."""
        if self.in_flight is None or self.voted:
            return  # outside steps() (e.g. a shadow iteration), or already voted
        fault.point("after-allreduce")  # test-only: a machine dies before its vote
        if self.block_in:  # fault injection (control `block`): a deadlocked worker
            group, self.block_in = self.core.groups[self.block_in], ""
            group.allreduce(torch.zeros(1))
        self.vote(self.in_flight)

    def vote(self, step: int) -> None:
        self.voted = True
        if self.stalls is not None:
            self.stalls.board.progress.voted = step
        if self.agreement is not None:
            with WAITS.waiting():  # waiting for the slowest voter is not computing
                self.agreement.vote(step)  # raises StepAborted: nothing is applied
        self.committed_in_flight = True

    def vote_unless_done(self, step: int) -> None:
        """After the step's body: a loop without an optimizer step still agrees on it."""
        if not (self.voted or self.discarded):
            try:
                self.vote(step)
            except StepAborted:
                self.discarded = True

    def end(self) -> None:
        """The step in flight ended, committed or discarded."""
        with self.core.cond:
            self.in_flight = None

    def committed(self, seconds: float) -> None:
        """The step ended committed, taking `seconds`."""
        if self.stalls is not None:
            self.stalls.step_done(seconds)

    def abort(self, reason: str, epoch: str | None = None) -> bool:
        """Aborts vote epoch `epoch` (the current one when None) for every rank; False
        when there is nothing to abort (a standby) or it was aborted already."""
        if self.agreement is None:
            return False
        return self.agreement.abort(reason, epoch)

    @property
    def last_vote_s(self) -> float:
        return self.agreement.last_vote_s if self.agreement else 0.0

    def _on_collective_failure(self, error: CollectiveError) -> None:
        """First failed collective of an epoch (training thread): report it, and abort
        the epoch for every rank through the store."""
        core = self.core
        core.log.error(
            "collective_error", group=error.group, peer=error.peer_machine, error=error.error
        )
        core.conn.notify(
            c.CollectiveErrorEvent(
                epoch=core.signal.epoch,
                step=self.in_flight or 0,
                group=error.group,
                peer_machine=error.peer_machine,
                error=error.error,
                t=time.time(),
            )
        )
        self.abort(f"collective error in {error.group}")

    def leave(self) -> None:
        """This rank hands its role over: its progress-board entry goes with it."""
        if self.stalls is not None:
            self.stalls.board.leave()

    def close(self) -> None:
        if self.agreement is not None:
            self.agreement.close()
        if self.stalls is not None:
            self.stalls.board.close()
