"""The worker side of a failure's recovery, in the order it happens.

1. `request` (control thread): the recover plan is accepted
   (`trainmover.runtime.acceptance` decides and refuses: superseded, in flight, a
   standby not named), recorded for the next boundary, and the current vote epoch is
   aborted, which gets every rank out of a step blocked on the dead machine. A planned
   migration the failure caught is given up, its groups never installed. A standby
   joiner starts building its groups at once, while its code builds the role.
2. `carry_out` (training thread, at the boundary; a standby joiner before its first
   step): every rank is at its last committed step (the step in flight was discarded).
   It starts the plan's epoch, agrees with the other survivors on the groups outside the
   delta that a member left dirty (`_dirty_groups`), rebuilds the delta and those, and
   restores the joiner from its state source over a transfer pair, or every rank from
   the last checkpoint common to all roles; then a new vote epoch starts and the rank
   reports `switched`.

When another machine fails meanwhile, a newer plan supersedes this one: a rank still
carrying the old one drops what it built and starts over with the newer one. That
includes the state's sender dying mid-transfer (`_transfer_cut`): the joiner applies
nothing it received and waits for the newer plan, which restores it from another
source.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Literal, NoReturn

from trainmover.runtime import checkpoint
from trainmover.runtime import control as c
from trainmover.runtime.abort import POLL_S, StepAborted
from trainmover.runtime.acceptance import Recovering
from trainmover.runtime.build import BuildAbandoned, GroupBuilder
from trainmover.runtime.core import Core, SupervisorGone
from trainmover.runtime.groups import Group, retire
from trainmover.runtime.logs import peak_rss_mib
from trainmover.runtime.plan import GroupSpec, Plan
from trainmover.runtime.storeclient import Store
from trainmover.runtime.transfer import TransferError


class RecoverySuperseded(RuntimeError):
    """A newer recover plan replaced the one this rank was carrying out (another machine
    failed meanwhile); the rank drops what it built and starts the newer one."""


class FailureRecovery:
    """Recover plans for one rank."""

    def __init__(
        self,
        core: Core,
        new_epoch: Callable[[str, int], None],
        abort_epoch: Callable[[str], object],
    ):
        self.core = core
        #: Starts vote epoch (id, committed step) once the rank is restored.
        self._new_epoch = new_epoch
        #: Aborts the current vote epoch for every rank (a no-op without one).
        self._abort_epoch = abort_epoch
        #: Failures this process lived through (see `Runtime.close`).
        self.count = 0
        #: A standby joiner's groups of a plan, building since the plan came (plan id).
        self._early: tuple[str, GroupBuilder] | None = None

    # -- 1. the request (control thread) -----------------------------------------------

    def request(self, msg: c.Recover) -> c.RecoverAck:
        core, plan = self.core, msg.plan
        with core.cond:
            decision = core.accepted.recover(plan)
            if decision.retry:
                return c.RecoverAck(part=decision.part, committed=core.committed)
            if msg.store:
                core.store_address = msg.store
            if decision.take is not None:
                core.take_role(decision.take)
            if decision.discarded is not None:
                decision.discarded.build.discard()
            if decision.part == "joiner":
                # The joiner's code builds its role now (the user's build, the optimizer's
                # priming) and needs none of these groups for that: build them meanwhile,
                # so the stayers rebuilding with it do not wait for its code.
                self._drop_early()
                name = f"recover-{plan.plan_id}"
                specs = sorted(plan.specs_for(core.me), key=lambda s: s.name)  # as `_recover`
                self._early = (plan.plan_id, core.builder(specs, name))
            core.cond.notify_all()
        if decision.part != "joiner":
            self._abort_epoch(f"recover {plan.plan_id}")
        core.log.info("recover", plan_id=plan.plan_id, part=decision.part, committed=core.committed)
        return c.RecoverAck(
            part=decision.part, committed=core.committed if decision.part != "joiner" else -1
        )

    def _drop_early(self) -> None:
        """Gives up a joiner's early build that no recovery will use (core.cond held)."""
        if self._early is not None:
            self._early[1].discard()
            self._early = None

    def close(self) -> None:
        """The process ends: an early build never used is given up."""
        with self.core.cond:
            self._drop_early()

    # -- 2. at the boundary (training thread) ------------------------------------------

    def carry_out(self, joiner: bool) -> None:
        """Carries out the recover plan in flight; when a newer plan supersedes it midway
        (another machine failed), starts over with that one."""
        while self.core.accepted.recovering is not None:
            try:
                self._recover(self.core.accepted.recovering, joiner)
            except RecoverySuperseded as exc:
                self.core.log.warning("recovery_superseded", error=str(exc))

    def _recover(self, rec: Recovering, joiner: bool) -> None:
        core = self.core
        role, state = core.accepted.role, core.state
        assert state is not None and role is not None
        plan, t_start = rec.plan, time.time()
        self.count += 1

        def superseded() -> bool:
            return core.accepted.recovering is not rec

        # The new epoch starts now: the recovery's own collectives must not see the old
        # epoch's abort (and a late abort of the old epoch can no longer reach them).
        core.signal.reset(plan.plan_id)
        store = core.store()
        prefix = f"{core.config.job}/recover/{plan.plan_id}/"
        specs = plan.specs_for(core.me)
        repaired = [] if joiner else self._dirty_groups(plan, store, prefix, superseded)
        specs = sorted([*specs, *repaired], key=lambda s: s.name)
        with core.cond:
            early, self._early = self._early, None
        if early is not None and (not joiner or early[0] != plan.plan_id):
            early[1].discard()
            early = None
        builder = early[1] if early else core.builder(specs, f"recover-{plan.plan_id}")
        try:
            built = builder.wait(core.timeout_s, abandon=superseded)
        except BuildAbandoned as exc:
            raise RecoverySuperseded(f"{plan.plan_id}: {exc}") from None
        build_s = time.time() - t_start
        transfer_bytes, transfer_s, waited_s = 0, 0.0, 0.0
        pairs = [g for g in built if g.spec.kind == "transfer"]
        built = [g for g in built if g.spec.kind != "transfer"]
        source: Literal["replica", "checkpoint"]
        if plan.restore == "checkpoint":
            lay = core.config.layout
            roles = [r for cell in lay.cells() for r in lay.roles_of(cell)]
            step = checkpoint.agree_step(
                store,
                prefix,
                role,
                roles,
                core.checkpoint_root,
                core.timeout_s,
                core.config.runtime.checkpoint_every,
            )
            checkpoint.load(core.checkpoint_root, role, step, state)
            source = "checkpoint"
        else:
            source, rt = "replica", core.config.runtime
            if pairs:
                core.log.info("transferring", plan_id=plan.plan_id, peak_rss_mib=peak_rss_mib())
            try:
                for pair in pairs:
                    stats = (
                        state.receive(pair, peer=0)
                        if joiner
                        else state.send(
                            pair, 1, {"epoch": plan.plan_id}, rt.chunk_bytes, rt.transfer_checksum
                        )
                    )
                    transfer_bytes += stats.bytes
                    transfer_s += stats.seconds
                    waited_s += stats.waited_s
            except (StepAborted, TransferError) as exc:
                self._transfer_cut(rec, [*built, *pairs], exc, superseded)
            if joiner:
                core.replica_state_at = state.step
        # Shutting down never blocks, even with an abandoned work in a replaced group.
        retire(core.groups.install(built))
        core.torch.installed([g.spec.kind for g in built], recovery=True)
        retire(pairs)
        self._new_epoch(plan.plan_id, state.step)
        with core.cond:
            core.accepted.recovered(rec)  # a newer plan that came meanwhile: next boundary
        event = c.Switched(
            plan_id=plan.plan_id,
            step=state.step,
            part=rec.part,
            rebuilt=sorted(s.name for s in specs if s.kind != "transfer" and not s.repair),
            repaired=sorted(s.name for s in repaired),
            t_start=t_start,
            t_end=time.time(),
            transfer_bytes=transfer_bytes,
            transfer_s=transfer_s,
            source=source,
            build_s=build_s,
            digest=state.digest() if core.config.runtime.report_digest else "",
        )
        core.log.info(
            "recovered",
            plan_id=plan.plan_id,
            part=rec.part,
            step=event.step,
            source=source,
            rebuilt=event.rebuilt,
            repaired=event.repaired,
            transfer_bytes=transfer_bytes,
            transfer_s=round(transfer_s, 4),
            transfer_wait_s=round(waited_s, 4),
            seconds=round(event.t_end - t_start, 4),
            peak_rss_mib=peak_rss_mib(),
        )
        core.conn.notify(event)

    def _transfer_cut(
        self, rec: Recovering, groups: list[Group], exc: Exception, superseded: Callable[[], bool]
    ) -> NoReturn:
        """The state did not cross whole: the other end of a transfer pair died (a joiner,
        or the replica sending), a chunk failed its checksum, or a newer plan aborted the
        epoch. Nothing received was applied. A peer's death brings a newer recover plan
        (without it, or from the checkpoint when the replica is gone), waited for here;
        this rank then drops what it built and starts over with it. The groups stay open
        until then: closing them would look to the others like this rank failing."""
        core = self.core
        core.log.warning("recovery_transfer_failed", plan_id=rec.plan.plan_id, error=str(exc)[:300])
        try:
            with core.cond:
                core.cond.wait_for(
                    lambda: superseded() or core.accepted.stopped, timeout=core.timeout_s
                )
                newer = superseded()
        finally:
            retire(groups)
        if not newer:
            raise SupervisorGone(f"no newer recovery after a failed transfer: {exc}") from exc
        raise RecoverySuperseded(f"{rec.plan.plan_id}: transfer failed: {exc}") from exc

    def _dirty_groups(
        self,
        plan: Plan,
        store: Store,
        prefix: str,
        superseded: Callable[[], bool],
    ) -> list[GroupSpec]:
        """Groups outside the delta that some member left dirty (an abandoned work), as
        repair specs. Every survivor publishes its own dirty groups, then reads those of
        its groups' members, so all members of a group decide the same."""
        core = self.core
        mine = sorted(g.name for g in core.groups.values() if g.dirty)
        store.set(f"{prefix}dirty/{core.me}", json.dumps(mine))
        delta = {s.name for s in plan.groups}
        repairs = []
        for group in core.groups.values():
            if group.name in delta:
                continue
            keys = [f"{prefix}dirty/{m}" for m in group.spec.members]
            self._wait_keys(store, keys, superseded)
            if any(group.name in json.loads(store.get(k)) for k in keys):
                repairs.append(group.spec.model_copy(update={"repair": plan.plan_id}))
        return repairs

    def _wait_keys(self, store: Store, keys: list[str], superseded: Callable[[], bool]) -> None:
        """Until every key is in the store; a member that failed never writes its key, so
        a newer recover plan (which leaves it out) ends the wait. The store has no way to
        wake us, so it is polled between waits on our own condition."""
        core = self.core
        deadline = time.monotonic() + core.timeout_s
        while not store.check(keys):
            with core.cond:
                if superseded():
                    raise RecoverySuperseded(f"stopped waiting for {keys}")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"store keys {keys} not set in {core.timeout_s}s")
                core.cond.wait(POLL_S)
