"""The executor's `Migration` in this process: its commands delivered to each machine's
`MachineWorkers` over an in-memory transport instead of the bus (the in-process
harness, `trainmover.localjob`, runs its plans with it).

The sidecar's own ops have their harness meaning: `release` waits for the leaver's
workers to exit (no maintenance follows), and `abort` leaves a failed plan's joiner as
it is. Every other op is the workers' (`MachineWorkers.handle`), exactly as a sidecar
runs it. Nothing survives this process, so a record is never saved for a restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from trainmover.messages import Command, CommandReply, MigrationProgress, Plan
from trainmover.services.executor.migration import Migration, MigrationFailed, MigrationRecord
from trainmover.services.sidecar.workers import MachineWorkers


class InMemoryExecutor:
    """Runs plans to their end over `machines` (name -> its workers); `survivors` names
    the machines holding a role (who takes part in a recovery)."""

    def __init__(
        self,
        machines: dict[str, MachineWorkers],
        survivors: Callable[[], list[str]],
        timeout_s: float,
    ) -> None:
        self.machines = machines
        self._survivors = survivors
        self.timeout_s = timeout_s
        #: Called once, before the first `transfer` of the running plan: every commit
        #: was taken by then (the harness lifts a hold at the switch step here).
        self.on_committed: Callable[[], None] | None = None
        #: Called with k once every affected machine of the running plan took commit(k):
        #: the harness lets its held job reach a switch step the Migration picked past
        #: its hold. Lifted before, a rank could train past k before its own commit came.
        self.on_commit: Callable[[int], None] | None = None
        #: The affected machines of the running plan, and those that took each commit(k).
        self._affected: set[str] = set()
        self._took: dict[int, set[str]] = {}

    def run(
        self, plan: Plan, commit_step: int | None, margin: int, timeout_s: float
    ) -> tuple[MigrationRecord, dict[str, float]]:
        """Runs `plan` with the executor's Migration (the switch step fixed when
        `commit_step` is given); returns the final record and when each state began.
        MigrationFailed when it did not end done."""
        stamps: dict[str, float] = {}
        self._affected, self._took = set(plan.affected_machines()), {}

        async def publish(progress: MigrationProgress) -> None:
            stamps.setdefault(progress.state, progress.ts)

        async def survivors() -> list[str]:
            return self._survivors()

        migration = Migration(
            None,
            MigrationRecord(plan=plan, commit_step=commit_step),
            _no_save,
            publish,
            survivors,
            margin=margin,
            timeout_s=timeout_s,
            send=self.send,
        )
        record = asyncio.run(migration.run())
        if record.phase != "done":
            raise MigrationFailed(f"plan {plan.plan_id}: {record.error}")
        return record, stamps

    async def send(self, command: Command) -> CommandReply:
        """One command to its machine's workers; its failure becomes the reply's error."""
        workers = self.machines[command.machine]
        timeout = float(command.args.get("timeout_s", self.timeout_s))
        try:
            if command.op == "release":
                await asyncio.to_thread(workers.wait_exited, timeout)
                result: dict[str, object] = {"released": True}
            elif command.op == "abort":
                result = {"relaunched": False}
            else:
                if command.op == "transfer" and self.on_committed is not None:
                    hook, self.on_committed = self.on_committed, None
                    await asyncio.to_thread(hook)
                result = await asyncio.to_thread(workers.handle, command, timeout)
                if command.op == "commit" and not result.get("refused"):
                    await self._took_commit(command.machine, int(command.args["step"]))
        except Exception as err:
            return CommandReply(
                command_id=command.command_id, ok=False, error=f"{type(err).__name__}: {err}"
            )
        return CommandReply(command_id=command.command_id, ok=True, result=result)

    async def _took_commit(self, machine: str, step: int) -> None:
        took = self._took.setdefault(step, set())
        took.add(machine)
        if took >= self._affected and self.on_commit is not None:
            await asyncio.to_thread(self.on_commit, step)


async def _no_save(record: MigrationRecord) -> None:
    """Nothing to resume from: the harness has no executor restart."""
