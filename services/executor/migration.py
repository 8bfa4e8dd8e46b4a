"""One migration as an explicit state machine of idempotent commands to the sidecars.

    planned:    phase1 -> committing -> transferring -> releasing -> done
    unplanned:  recovering -> transferring -> done     (the leaver is gone)

- phase1: `prepare` to the joiner and every stayer of the delta (and the leaver, which
  builds its transfer pair); each replies once its ranks built their new groups while
  training went on.
- committing: the switch step k is picked ahead of the furthest rank (`margin` steps),
  *recorded*, then sent as `commit(k)` to the same machines (the joiners' acked first);
  a round that any rank refused as too late (the record write waited for the bus, or
  fast steps outran the margin) is dropped by the ranks and repeated with a later k
  (`switch`).
- transferring: `transfer` waits until every affected rank switched at the boundary
  after k (the leaver sent its state one-to-one to the joiner and exited).
- releasing: the leaver's sidecar takes the machine into maintenance.
- recovering (a failure, or its checkpoint-restart fallback): `recover` to every
  surviving machine of the job and to the joiner: each rank aborts its step, the delta
  groups are built, the joiner gets its state from a data-parallel replica (or every
  rank reloads the last common checkpoint), and all resume from one committed step.

Every state is stored before its commands go out, and every command id is derived from
(plan, op, machine), so an executor restarted at any point re-sends the same commands
and the sidecars answer a command they already ran from their memory of it.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

from nats.aio.client import Client as NatsClient
from pydantic import ConfigDict, Field, model_validator

from trainmover import bus
from trainmover.logs import get_logger
from trainmover.messages import (
    Command,
    CommandOp,
    CommandReply,
    Message,
    MigrationProgress,
    MigrationState,
    Plan,
)
from trainmover.planwire import plan_args
from trainmover.runtime.supervisor import WorkerDied
from trainmover.services.executor.switch import COMMIT_ROUNDS, judge_commit, switch_step
from trainmover.tasks import gather_all

log = get_logger("executor")

Phase = Literal[
    "phase1", "committing", "recovering", "transferring", "releasing", "done", "failed", "withdrawn"
]
"""`withdrawn`: the planner cancelled the plan (a recovery superseded it); nothing more
is sent for it and no progress is published (the planner reported the event's fate)."""


class MigrationRecord(Message):
    """The executor's durable memory of one migration (key migration.<plan_id>)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=False)

    plan: Plan
    phase: Phase = "phase1"
    commit_step: int | None = None
    #: Commit rounds refused as too late so far (see `switch`): the next k's margin.
    commit_round: int = 0
    started_ts: float = Field(default_factory=time.time)
    phases: dict[str, float] = Field(default_factory=dict)
    results: dict[str, dict[str, Any]] = Field(default_factory=dict)
    groups_total: int | None = None
    error: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _named_step_before(cls, data: Any) -> Any:
        """A record stored by an executor of an earlier version names its phase `step`:
        an upgraded executor resumes it rather than refusing it."""
        if isinstance(data, dict) and "step" in data and "phase" not in data:
            data = {("phase" if k == "step" else k): v for k, v in data.items()}
        return data


class MigrationFailed(RuntimeError):
    """A command of the migration failed; `lost` names its machine where the reason was
    that machine's worker dying (the health monitor reports that death as a failure)."""

    def __init__(self, message: str, lost: str | None = None) -> None:
        super().__init__(message)
        self.lost = lost


def downtime(before_end: float, after_end: float, median_step_s: float) -> float:
    """docs/glossary.md: from the end of the last step completed before the migration to the end
    of the first step completed after it, minus one normal step."""
    return max(0.0, after_end - before_end - median_step_s)


Publish = Callable[[MigrationProgress], Awaitable[None]]
Save = Callable[[MigrationRecord], Awaitable[None]]
Survivors = Callable[[], Awaitable[list[str]]]
"""The machines of the job that are alive and keep their roles (for a recovery)."""
Send = Callable[[Command], Awaitable[CommandReply]]
"""Sends one command to its machine's sidecar and returns the reply."""
Settle = Callable[[str], Awaitable[None]]
"""Given a machine whose worker died mid-migration, returns once the planner has had its
time to take the plan over with that machine's recovery (which withdraws the plan and so
cancels this migration's task); the migration is reported failed only after it."""


class Migration:
    """Runs (or resumes) one plan from its record."""

    def __init__(
        self,
        nc: NatsClient | None,
        record: MigrationRecord,
        save: Save,
        publish: Publish,
        survivors: Survivors,
        *,
        margin: int = 2,
        timeout_s: float = 120.0,
        # Short attempts: a command lost with its connection (a nats-server restart) is
        # sent again soon, and a retry of a long-running command only waits for the same
        # run (sidecars answer by command id), so retrying often costs nothing.
        attempt_s: float = 5.0,
        send: Send | None = None,
        settle: Settle | None = None,
    ) -> None:
        """`send` replaces the bus (`nc`) as the way commands reach the sidecars."""
        self._nc = nc
        self._send = send or self._request
        self.record = record
        self._save = save
        self._publish = publish
        self._survivors = survivors
        self.margin = margin
        self.timeout_s = timeout_s
        self.attempt_s = attempt_s
        self._settle = settle
        #: The end decided (terminal progress state and detail) and maybe not yet
        #: published: a `run` again after a write that failed publishes it again.
        self._end: tuple[MigrationState, str] | None = None
        #: The step each affected machine had reached when its prepare was answered (its
        #: ranks ready), by this run's own prepare round; None after a restart.
        self._prepared_at: list[int] | None = None

    @property
    def plan(self) -> Plan:
        return self.record.plan

    @functools.cached_property
    def _plan_args(self) -> dict[str, str]:
        # Encoded once for every command of the migration: the plan grows with the job
        # (a data-parallel group has a member per replica), and encoding it for each of
        # thousands of machines made a round O(n²) in the executor.
        return plan_args(self.plan)

    @property
    def moves(self) -> dict[str, str]:
        """leaver -> joiner, for every move of the plan."""
        return {m.leaver: m.joiner for m in self.plan.moves}

    @property
    def leaver(self) -> str:
        """The first leaver (by name): what a one-move reader of the progress sees."""
        return min(self.moves)

    @property
    def joiner(self) -> str:
        return self.moves[self.leaver]

    def _together(self) -> str:
        return ", ".join(f"{leaver} -> {joiner}" for leaver, joiner in sorted(self.moves.items()))

    def affected(self) -> list[str]:
        return sorted(self.plan.affected_machines())

    async def run(self) -> MigrationRecord:
        """Drives the record to done (or failed); returns the final record. Raises only
        where the bus refused a write past its failover; calling it again then goes on
        from where it stopped."""
        if self._end is not None:
            await self._save(self.record)
            await self._progress(*self._end, final=True)
            return self.record
        if self.plan.migration != "planned" and self.record.phase == "phase1":
            self.record.phase = "recovering"
        try:
            while self.record.phase not in ("done", "failed"):
                await self._advance()
        except bus.BUS_FAILOVER_ERRORS:
            # A record or progress the bus did not take, even past its failover: not a
            # failure of the migration (after the switch, failing would abort a joiner
            # that holds its role). Every phase can run again: the caller runs it again.
            raise
        except Exception as err:
            if self._end is not None:
                raise  # decided; only its record or progress was not written: run again
            # Reported as failed at once, a dead leaver's drain would race that leaver's
            # failure event: the recovery could no longer keep the joiner it prepared.
            lost = err.lost if isinstance(err, MigrationFailed) else None
            if lost is not None and self._settle is not None:
                await self._settle(lost)
            return await self._fail(f"{self.record.phase}: {type(err).__name__}: {err}")
        return self.record

    async def _advance(self) -> None:
        phase = self.record.phase
        t0 = time.time()
        if phase == "phase1":
            await self._progress("phase1", "building the delta groups in the background")
            results = await self._all("prepare", self.affected())
            self.record.results["prepare"] = results
            if all("step" in r for r in results.values()):
                self._prepared_at = [int(r["step"]) for r in results.values()]
            self._phase("prepare", t0)
            await self._enter("committing")
        elif phase == "committing":
            k = self.record.commit_step
            if k is None:
                # The steps the prepare round was answered at are fresh enough: the last
                # answer ended it, and a k the ranks passed meanwhile is refused and picked
                # again. A run resumed after a restart asks where the ranks are now.
                passed = self._prepared_at
                if passed is None:
                    statuses = await self._all("status", self.affected(), plan=False)
                    passed = [int(r["step"]) for r in statuses.values()]
                k = await self._pick_switch_step(passed)
            while True:
                outcome = judge_commit(await self._commit_round(k), self.plan.joiners())
                if outcome.verdict == "accepted":
                    break
                if outcome.verdict == "failed" or self.record.commit_round + 1 >= COMMIT_ROUNDS:
                    raise MigrationFailed(f"commit({k}): {outcome.detail}")
                log.warning(
                    "commit_too_late",
                    job=self.plan.job,
                    plan_id=self.plan.plan_id,
                    step=k,
                    passed=outcome.passed,
                    round=self.record.commit_round,
                    detail=outcome.detail,
                )
                self.record.commit_round += 1
                k = await self._pick_switch_step([outcome.passed])
            await self._progress("committing", f"switch after step {self.record.commit_step}")
            self._phase("commit", t0)
            await self._enter("transferring")
        elif phase == "recovering":
            machines = self.record.results.get("machines", {}).get("recovery")
            if machines is None:
                joiners = sorted(self.plan.joiners())
                machines = sorted(set(await self._survivors()) - self.plan.leavers()) + joiners
                self.record.results["machines"] = {"recovery": machines}
                await self._save(self.record)  # the same machines, even across a restart
            source = "the last checkpoint" if not self.plan.transfers else "a replica"
            await self._progress("recovering", f"every rank resumes; state from {source}")
            self.record.results["recover"] = await self._all("recover", machines)
            self._phase("recover", t0)
            await self._enter("transferring")
        elif phase == "transferring":
            recovery = self.plan.migration != "planned"
            machines = self.record.results["machines"]["recovery"] if recovery else self.affected()
            await self._progress("transferring", "state to the joiner")
            results = await self._all("transfer", machines)
            self.record.results["transfer"] = results
            self._phase("switch", t0)
            if recovery:  # every rank resumed after the last step all of them committed
                self.record.commit_step = max(int(r["step"]) for r in results.values())
            await self._measure()
            if recovery:
                await self._end_with("done", self._summary())
            else:
                await self._enter("releasing")
        elif phase == "releasing":
            leavers = ", ".join(sorted(self.plan.leavers()))
            await self._progress("releasing", f"{leavers} go(es) to maintenance")
            await self._all("release", list(self.plan.leavers()))
            self._phase("release", t0)
            await self._end_with("done", self._summary())

    async def _measure(self) -> None:
        """Downtime from the step timelines of the ranks around the switch step."""
        k = self.record.commit_step
        assert k is not None
        if self.plan.migration == "planned":
            stayers = sorted(self.plan.stayers())
        else:
            stayers = sorted(set(self.record.results["machines"]["recovery"]) - self.plan.joiners())
        after_machines = [*stayers, *sorted(self.plan.joiners())]
        if not stayers:
            # Every machine of the job was replaced: no rank's timeline spans the move.
            return
        # One round, not two: each machine answers once its step is over, and the
        # stayers' step k ended before anyone's k + 1 could.
        before, after = await gather_all(
            [
                self._all("steps", stayers, plan=False, step=k),
                self._all("steps", after_machines, plan=False, step=k + 1),
            ]
        )
        before_end = max(float(r["t_end"]) for r in before.values())
        after_end = max(float(r["t_end"]) for r in after.values())
        median = statistics.median(float(r["median_step_s"]) for r in before.values())
        self.record.results["timeline"] = {
            "before_end": before_end,
            "after_end": after_end,
            "median_step_s": median,
        }
        self.record.phases["downtime"] = downtime(before_end, after_end, median)
        transfers = self.record.results.get("transfer", {})
        # Several moves run side by side: the slowest one is the migration's.
        joined = [float(transfers[j]["t_end"]) for j in self.plan.joiners() if j in transfers]
        if joined:
            self.record.phases["first_step"] = max(0.0, after_end - min(joined))
        senders = [transfers[m] for m in self.plan.sources() if m in transfers]
        if senders:
            self.record.phases["transfer"] = max(float(r.get("transfer_s", 0.0)) for r in senders)

    async def _commit_round(self, k: int) -> dict[str, dict[str, Any]]:
        """commit(k) to the joiners first, then to the leavers and stayers: no rank can
        switch at k (and wait there for its joiner) before every joiner holds k, so a
        commit the bus is slow to deliver delays the switch, never the training."""
        joiners = sorted(self.plan.joiners())
        first = await self._all("commit", joiners, step=k)
        rest = [m for m in self.affected() if m not in first]
        return {**first, **await self._all("commit", rest, step=k)}

    async def _pick_switch_step(self, passed: Iterable[int]) -> int:
        """k for this commit round, recorded before any commit(k) goes out: a restarted
        executor re-sends the same k (a late one is then refused and picked again)."""
        k = switch_step(passed, self.margin, self.record.commit_round)
        self.record.commit_step = k
        await self._save(self.record)
        return k

    def _summary(self) -> str:
        rebuilt = len(self.plan.groups)
        return f"{self._together()} at step {self.record.commit_step}; rebuilt {rebuilt} groups"

    # --- plumbing ---------------------------------------------------------------------

    async def _all(
        self, op: CommandOp, machines: list[str], plan: bool = True, **args: Any
    ) -> dict[str, dict[str, Any]]:
        """Sends `op` to every machine at once; all must succeed. The first failure
        ends the others' sends (their retries to a machine that may meanwhile be
        relaunched as someone else would outlive the migration)."""

        carried = self._plan_args if plan else {}

        async def one(machine: str) -> dict[str, Any]:
            payload: dict[str, Any] = {**args, **carried, "timeout_s": self.timeout_s}
            suffix = f".{args['step']}" if "step" in args else ""
            command = Command(
                command_id=f"{self.plan.plan_id}.{op}.{machine}{suffix}",
                job=self.plan.job,
                machine=machine,
                op=op,
                plan_id=self.plan.plan_id,
                args=payload,
            )
            reply = await self._send(command)
            if not reply.ok:
                died = (reply.error or "").startswith(f"{WorkerDied.__name__}:")
                raise MigrationFailed(
                    f"{op} on {machine}: {reply.error}", machine if died else None
                )
            return reply.result

        results = await gather_all(one(m) for m in machines)
        return dict(zip(machines, results, strict=True))

    async def _request(self, command: Command) -> CommandReply:
        assert self._nc is not None, "a migration without a send needs a bus connection"
        return await bus.request(
            self._nc, command, timeout=self.attempt_s, deadline_s=self.timeout_s
        )

    def _phase(self, name: str, t0: float) -> None:
        self.record.phases[name] = time.time() - t0

    async def _enter(self, phase: Phase) -> None:
        self.record.phase = phase
        await self._save(self.record)

    async def _end_with(self, state: MigrationState, detail: str) -> None:
        """Stores the record's end, then publishes it to the event(s)."""
        self._end = (state, detail)
        await self._enter("done" if state == "done" else "failed")
        await self._progress(state, detail, final=True)

    async def _progress(self, state: MigrationState, detail: str, final: bool = False) -> None:
        """Published for the plan's event and for every failure event it merged (a
        recovery that superseded another ends that one's event too)."""
        for event_id in [self.plan.event_id, *self.plan.merged_events]:
            await self._publish(
                MigrationProgress(
                    job=self.plan.job,
                    event_id=event_id,
                    plan_id=self.plan.plan_id,
                    state=state,
                    detail=detail,
                    leaver=self.leaver,
                    joiner=self.joiner,
                    moves=self.moves,
                    downtime_s=self.record.phases.get("downtime") if final else None,
                    phases=dict(self.record.phases) if final else {},
                    groups_rebuilt=sorted(g.name for g in self.plan.groups) if final else [],
                    groups_total=self.record.groups_total if final else None,
                )
            )

    async def _fail(self, error: str) -> MigrationRecord:
        log.error(
            "migration_failed",
            job=self.plan.job,
            plan_id=self.plan.plan_id,
            event_id=self.plan.event_id,
            phase=self.record.phase,
            error=error,
        )
        # Nobody switched yet: the leavers still hold their roles and train on.
        before_switch = self.record.phase in ("phase1", "committing")
        retry = self.plan.migration == "planned" and before_switch and self.plan.retries_left > 0
        self.record.error = error
        if self.plan.migration == "planned":
            # A joiner may hold its role already and cannot give it back: its sidecar
            # relaunches it as a standby (the planner keeps it in maintenance meanwhile).
            # A leaver that never handed its role over trains on: its sidecar says so.
            told = self.plan.joiners() | (self.plan.leavers() if before_switch else set())
            try:
                await self._all("abort", sorted(told))
            except Exception as err:  # a dead joiner does not answer; the monitor saw it
                log.warning("abort_failed", plan_id=self.plan.plan_id, error=str(err))
        # The leaver of a retried plan trains on: the planner plans the event again.
        await self._end_with("retrying" if retry else "failed", error)
        return self.record
