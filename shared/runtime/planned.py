"""The worker side of a planned migration, in the order it happens.

1. `prepare` (control thread): phase 1. The rank takes its part in the plan (leaver,
   joiner or stayer: `trainmover.runtime.acceptance` decides and refuses), a joiner takes
   the leaver's role, and the rank's groups of the delta start building in the
   background while training goes on over the old ones.
2. `_report_ready` (a waiter thread): once built, `ready` (or `plan_failed`) goes to the
   supervisor, with how many steps trained during the build.
3. `commit` (control thread): phase 2 is fixed at a step the rank has not passed yet;
   nothing changes before that boundary. The rank's answer goes into the switch
   agreement (`trainmover.runtime.switchvote`): k holds only if every committer took it.
4. `switch` (training thread, at the boundary after the commit step, once k holds; a k
   that a committer refused is dropped and training goes on): a leaver sends
   its full state to its joiner over the transfer pair, shuts its groups down and
   leaves; a stayer swaps in its new groups and trains on.
5. `join` (training thread, a joiner before its first step): waits for a commit that
   holds, receives the leaver's state, installs its groups and trains from the leaver's step.

Each rank reports `switched` when done. A failure's recover plan supersedes a migration
still in flight (`trainmover.runtime.recovery`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from trainmover.runtime import control as c
from trainmover.runtime import pipelines
from trainmover.runtime.abort import StepAborted
from trainmover.runtime.acceptance import Planned
from trainmover.runtime.build import GroupBuilder
from trainmover.runtime.core import Core, SupervisorGone
from trainmover.runtime.groups import Group, retire
from trainmover.runtime.logs import peak_rss_mib
from trainmover.runtime.switchvote import DROP, SWITCH, SwitchVote
from trainmover.runtime.transfer import TransferError


def transfer_group(built: list[Group]) -> Group:
    """The transfer pair among a plan's built groups."""
    return next(g for g in built if g.spec.kind == "transfer")


class PlannedSwitch:
    """Phase 1, commit and phase 2 of planned migrations for one rank."""

    def __init__(
        self, core: Core, new_epoch: Callable[[str, int], None], leave: Callable[[], None]
    ):
        self.core = core
        #: Starts vote epoch (id, committed step): a joiner's, once it has the state.
        self._new_epoch = new_epoch
        #: Takes a leaver's entry off the progress board as it hands its role over.
        self._leave = leave

    # -- 1. phase 1 (control thread) ---------------------------------------------------

    def prepare(self, msg: c.Prepare) -> c.PrepareAck:
        """Starts building this rank's groups of the delta in the background."""
        core, plan = self.core, msg.plan
        with core.cond:
            if msg.store:
                core.store_address = msg.store
            generations = {g.spec.kind: g.generation for g in core.groups.values()}
            decision = core.accepted.prepare(plan, generations)
            building = [s.name for s in decision.specs]
            if decision.retry:
                return c.PrepareAck(step=core.accepted.passed, building=building)
            if decision.replaced is not None:
                core.log.warning(
                    "plan_replaced", plan_id=decision.replaced.plan.plan_id, by=plan.plan_id
                )
                decision.replaced.build.discard()
            if decision.take is not None:
                core.take_role(decision.take)
            builder = core.builder(decision.specs, f"prepare-{plan.plan_id}")
            mig = core.accepted.prepared(plan, decision.part, builder)
            passed = core.accepted.passed
            core.cond.notify_all()
        core.log.info("prepare", plan_id=plan.plan_id, part=decision.part, building=building)
        threading.Thread(target=self._report_ready, args=(mig, builder), daemon=True).start()
        return c.PrepareAck(step=passed, building=building)

    # -- 2. ready (waiter thread): groups built, and a joiner's role too ---------------

    def _report_ready(self, mig: Planned, builder: GroupBuilder) -> None:
        core = self.core
        try:
            built = builder.wait(core.timeout_s)
            if mig.part == "joiner" and not core.tracked.wait(core.timeout_s):
                raise TimeoutError(f"the role was not built within {core.timeout_s:.0f} s")
        except Exception as exc:
            core.log.error("prepare_failed", plan_id=mig.plan.plan_id, error=str(exc))
            core.conn.notify(c.PlanFailed(plan_id=mig.plan.plan_id, error=str(exc)))
            return
        core.log.info(
            "ready",
            plan_id=mig.plan.plan_id,
            build_s=round(builder.elapsed_s, 4),
            steps_during_build=mig.steps_during_build,
        )
        core.conn.notify(
            c.Ready(
                plan_id=mig.plan.plan_id,
                built=[g.name for g in built],
                build_s=builder.elapsed_s,
                steps_during_build=mig.steps_during_build,
            )
        )

    # -- 3. commit (control thread) ----------------------------------------------------

    def commit(self, msg: c.Commit) -> c.CommitAck:
        """Takes k = `msg.step`, or refuses it; a committer's answer is recorded in the
        switch agreement (`trainmover.runtime.switchvote`) before it is sent."""
        core = self.core
        with core.cond:
            decision = core.accepted.commit(msg.plan_id, msg.step)
            passed = core.accepted.passed
            mig = core.accepted.planned
            if decision.accepted:
                core.cond.notify_all()
        vote = self._vote(msg.plan_id)
        if not decision.accepted:
            core.log.warning(
                "commit_refused", plan_id=msg.plan_id, step=msg.step, reason=decision.reason
            )
            try:
                vote.refuse(msg.step)
            except RuntimeError as exc:  # a standby that never learnt the store
                core.log.warning("commit_refusal_not_recorded", error=str(exc))
            return c.CommitAck(accepted=False, passed=passed, reason=decision.reason)
        if decision.part != "joiner" and not decision.retry:
            assert mig is not None
            vote.accept(msg.step, len(mig.plan.committers()))
        core.log.info(
            "commit",
            plan_id=msg.plan_id,
            step=msg.step,
            retry=decision.retry,
            peak_rss_mib=peak_rss_mib(),
        )
        return c.CommitAck(accepted=True, passed=passed)

    def _vote(self, plan_id: str) -> SwitchVote:
        return SwitchVote(self.core.config.job, plan_id, self.core.store)

    def _agreed(self, mig: Planned, step: int) -> bool:
        """Whether every committer took k = `step` (the switch agreement's decision);
        False also when, while this rank waited for it, a recovery came, the rank was
        stopped or k was replaced. A dropped k is forgotten: a later commit replaces it."""
        core = self.core

        def keep_waiting() -> bool:
            with core.cond:
                return (
                    mig.commit_step == step
                    and core.accepted.recovering is None
                    and not core.accepted.stopped
                )

        decision = self._vote(mig.plan.plan_id).decision(step, keep_waiting, core.timeout_s)
        if decision == DROP:
            core.log.warning("switch_dropped", plan_id=mig.plan.plan_id, step=step)
            with core.cond:
                core.accepted.dropped(mig, step)
                core.cond.notify_all()
        return decision == SWITCH

    # -- 4. the switch at the commit step (training thread) ----------------------------

    def switch(self, step: int) -> Literal["left", "switched", "not agreed"]:
        """Phase 2 at the boundary after `step`, for a leaver or a stayer, once every
        committer took it ("not agreed": nothing changed, the boundary is crossed anew)."""
        core = self.core
        mig = core.accepted.planned
        assert mig is not None and core.state is not None
        if not self._agreed(mig, step):
            return "not agreed"
        t_start = time.time()
        built = _builder(mig).wait(core.timeout_s)
        if mig.part == "leaver":
            self._leave()
            transfer = transfer_group(built)
            core.log.info("transferring", plan_id=mig.plan.plan_id, peak_rss_mib=peak_rss_mib())
            rt = core.config.runtime
            extra = {"epoch": core.signal.epoch, "pp_shapes": pipelines.describe()}
            stats = core.state.send(transfer, 1, extra, rt.chunk_bytes, rt.transfer_checksum)
            transfer.shutdown()
            closed = [str(g["name"]) for g in core.groups.snapshot().values()]
            core.groups.shutdown()
            self._finish(
                mig,
                c.Switched(
                    plan_id=mig.plan.plan_id,
                    step=step,
                    part="leaver",
                    rebuilt=closed,
                    t_start=t_start,
                    t_end=time.time(),
                    transfer_bytes=stats.bytes,
                    transfer_s=stats.seconds,
                ),
            )
            return "left"
        retire(core.groups.install(built))
        core.torch.installed([g.spec.kind for g in built])
        self._finish(
            mig,
            c.Switched(
                plan_id=mig.plan.plan_id,
                step=step,
                part="stayer",
                rebuilt=[g.name for g in built],
                t_start=t_start,
                t_end=time.time(),
            ),
        )
        return "switched"

    # -- 5. a joiner's first boundary (training thread) --------------------------------

    def join(self) -> bool:
        """A joiner's phase 2: wait for the commit, receive the leaver's state, install
        its new groups; training then continues from the leaver's step. False when a
        recovery superseded the migration before its commit, or its transfer failed (its
        leaver died)."""
        core = self.core
        mig = core.accepted.planned
        assert mig is not None and core.state is not None
        while True:
            with core.cond:
                core.cond.wait_for(lambda: core.accepted.join(mig) != "wait")
                outcome, step = core.accepted.join(mig), mig.commit_step
            if outcome != "commit":
                break
            assert step is not None
            if self._agreed(mig, step):
                break
            with core.cond:  # k was not agreed: a recovery or a stop ends the wait
                if core.accepted.recovering is not None:
                    outcome = "superseded"
                elif core.accepted.stopped:
                    outcome = "stopped"
                else:
                    continue  # k dropped or replaced: wait for the next commit
            break
        if outcome == "superseded":
            return False
        if outcome == "stopped":
            raise SupervisorGone("stopped before the commit")
        t_start = time.time()
        built = _builder(mig).wait(core.timeout_s)
        transfer = transfer_group(built)
        core.log.info("transferring", plan_id=mig.plan.plan_id, peak_rss_mib=peak_rss_mib())
        receiving = time.perf_counter()
        try:
            stats = core.state.receive(transfer, peer=0)
        except (StepAborted, TransferError) as exc:
            return self._transfer_failed(mig, built, exc)
        received = time.perf_counter()
        built.remove(transfer)
        retire([transfer])
        del transfer
        if core.state.step != mig.commit_step:
            raise RuntimeError(f"leaver sent step {core.state.step}, commit was {mig.commit_step}")
        role_groups = [g for g in built if g.spec.kind != "transfer"]
        core.groups.install(role_groups)
        shapes = str(stats.extra.get("pp_shapes", ""))
        core.torch.installed([g.spec.kind for g in role_groups], shapes=shapes)
        installed = time.perf_counter()
        self._new_epoch(str(stats.extra.get("epoch", "e0")), core.state.step)
        # Where the joiner's time after its leaver's last byte went (the downtime's tail).
        after_transfer = {
            "restore_s": received - receiving - stats.waited_s - stats.seconds,
            "install_s": installed - received,
            "epoch_s": time.perf_counter() - installed,
        }
        self._finish(
            mig,
            c.Switched(
                plan_id=mig.plan.plan_id,
                step=mig.commit_step,
                part="joiner",
                rebuilt=[g.name for g in role_groups],
                t_start=t_start,
                t_end=time.time(),
                transfer_bytes=stats.bytes,
                transfer_s=stats.seconds,
            ),
            transfer_wait_s=stats.waited_s,
            **after_transfer,
        )
        return True

    def _transfer_failed(self, mig: Planned, built: list[Group], exc: Exception) -> Literal[False]:
        """The leaver's state did not arrive whole (it died mid-transfer, or a chunk
        failed its checksum): nothing of it was applied, and this joiner never trains on
        it. Its leaver's failure brings a recovery that keeps this joiner for the role,
        with the state from the data-parallel replica; it is waited for here. The groups
        built for the migration stay open until then: closing them would look to the
        stayers, who switched to them, like this machine failing."""
        core = self.core
        core.log.warning("transfer_failed", plan_id=mig.plan.plan_id, error=str(exc)[:300])
        try:
            with core.cond:
                came = core.cond.wait_for(
                    lambda: core.accepted.recovering is not None or core.accepted.stopped,
                    timeout=core.timeout_s,
                )
                if not came or core.accepted.recovering is None:
                    raise SupervisorGone(f"no recovery after a failed transfer: {exc}") from exc
        finally:
            retire(built)
        return False

    def _finish(
        self, mig: Planned, event: c.Switched, transfer_wait_s: float = 0.0, **seconds: float
    ) -> None:
        """Reports the switch; a joiner also logs how long it waited for its leaver's
        first byte (its leaver's last step), which is downtime but not transfer, and
        `seconds` of what it did after the last byte."""
        core = self.core
        core.log.info(
            "switched",
            plan_id=event.plan_id,
            part=event.part,
            step=event.step,
            rebuilt=event.rebuilt,
            transfer_bytes=event.transfer_bytes,
            transfer_s=round(event.transfer_s, 4),
            transfer_wait_s=round(transfer_wait_s, 4),
            seconds=round(event.t_end - event.t_start, 4),
            peak_rss_mib=peak_rss_mib(),
            **{name: round(value, 4) for name, value in seconds.items()},
        )
        with core.cond:
            core.accepted.switched(mig)
        core.conn.notify(event)


def _builder(mig: Planned) -> GroupBuilder:
    assert isinstance(mig.build, GroupBuilder)
    return mig.build
