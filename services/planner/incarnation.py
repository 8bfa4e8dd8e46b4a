"""On an open bus, a returning machine's new incarnation is believed only once it answers.

A machine the planner released or declared failed comes back only as a fresh instance
(`pool`). Under `--auth` only that machine's sidecar may publish its heartbeats, so the
instance a heartbeat names is the sidecar's. On an open bus anyone may publish one, and
an invented instance would re-admit a frozen or fenced machine as a standby (a drain
planned onto it then fails a minute later). So there, before such a heartbeat is taken
in, the planner asks the machine, on its command subject, which instance runs there
(the sidecar's `status` reply names it), and believes the heartbeat only when the answer
names the same one. A refused one is dead-lettered with the reason; the machine is asked
again after `RETRY_S`.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NatsClient

from trainmover import bus
from trainmover.logs import get_logger
from trainmover.messages import Command, Heartbeat

log = get_logger("planner")

#: Seconds the sidecar has to answer (its workers answer `status`).
ANSWER_S = 5.0
#: Seconds before an instance that did not answer is asked again.
RETRY_S = 10.0
#: The instances remembered per outcome (names come from the wire: stay bounded).
REMEMBERED = 4096


class InstanceCheck:
    """Which (machine, instance) pairs answered; asks for those not asked yet."""

    def __init__(self, nc: NatsClient, job: str) -> None:
        self._nc, self._job = nc, job
        self._answered: set[tuple[str, str]] = set()
        self._refused: dict[tuple[str, str], float] = {}
        self._asking: dict[tuple[str, str], asyncio.Task[None]] = {}

    def believed(self, beat: Heartbeat, raw: bytes, subject: str) -> bool:
        """True once `beat`'s instance answered as its machine; else False, and it is
        asked (once, in the background) unless it was refused within RETRY_S."""
        key = (beat.machine, beat.instance)
        if key in self._answered:
            return True
        refused_at = self._refused.get(key)
        if key in self._asking or (refused_at and time.monotonic() - refused_at < RETRY_S):
            return False
        task = asyncio.create_task(self._ask(key, raw, subject))
        self._asking[key] = task
        task.add_done_callback(lambda _: self._asking.pop(key, None))
        return False

    async def _ask(self, key: tuple[str, str], raw: bytes, subject: str) -> None:
        machine, instance = key
        command = Command(job=self._job, machine=machine, op="status")
        try:
            reply = await bus.request(self._nc, command, timeout=ANSWER_S, retries=1)
            answered = str(reply.result.get("instance", "")) if reply.ok else ""
            why = "" if answered == instance else (
                f"its sidecar answers as instance {answered[:8]}" if answered
                else f"its sidecar could not say ({reply.error})"
            )  # fmt: skip
        except bus.CommandFailed as err:
            why = f"nobody answered on its command subject ({err})"
        if not why:
            if len(self._answered) > REMEMBERED:
                self._answered.clear()
            self._answered.add(key)
            log.info("instance_answered", job=self._job, machine=machine, instance=instance)
            return
        if len(self._refused) > REMEMBERED:
            self._refused.clear()
        self._refused[key] = time.monotonic()
        reason = (
            f"heartbeat of {machine} names a new instance {instance[:8]}, but {why}: on an "
            "open bus a returning machine is taken back only when it answers under it"
        )
        log.warning("heartbeat_refused", job=self._job, machine=machine, reason=reason)
        await bus.dead_letter(self._nc.jetstream(), self._job, subject, raw, reason, "planner")

    async def close(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()
        await asyncio.gather(*self._asking.values(), return_exceptions=True)
