"""Commands to a machine's sidecar: `request` sends one and retries with the same
`command_id`; `CommandServer` answers them, and replays its reply to a command it already
ran (so a retry never runs a command twice).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from trainmover.bus.connection import subscribe
from trainmover.bus.durable import dead_letter
from trainmover.bus.jobs import MAX_PAYLOAD
from trainmover.logs import get_logger
from trainmover.messages import Command, CommandReply, MessageError, decode
from trainmover.security import denials
from trainmover.subjects import JobSubjects

log = get_logger("bus")


class CommandFailed(RuntimeError):
    """A command got no reply after its retries, or the reply said it failed."""


async def request(
    nc: NatsClient,
    command: Command,
    *,
    timeout: float = 2.0,
    retries: int = 3,
    deadline_s: float | None = None,
) -> CommandReply:
    """Sends `command` to its machine's sidecar; retries with the same id.

    An attempt that times out is retried at once (the sidecar answers a retry from its
    memory of the first run); while nobody listens on the machine's subject (its sidecar
    is still starting) the next attempt waits a growing pause. Gives up after `retries`
    attempts, or, with `deadline_s`, once that many seconds have passed. Raises
    CommandFailed then, or when the reply is not a valid CommandReply. A reply with
    ok=False is returned, not raised.
    """
    subject = JobSubjects(command.job).command(command.machine)
    give_up = None if deadline_s is None else time.monotonic() + deadline_s
    last = ""
    attempt = 0
    while True:
        attempt += 1
        try:
            msg = await denials.of(nc).guard(
                nc.request(subject, command.to_json(), timeout=timeout), [subject]
            )
        except (NatsTimeout, NoRespondersError) as err:
            last = type(err).__name__
            log.info(
                "command_retry",
                job=command.job,
                machine=command.machine,
                op=command.op,
                command_id=command.command_id,
                attempt=attempt,
                plan_id=command.plan_id,
                error=last,
            )
            out_of_time = give_up is not None and time.monotonic() >= give_up
            if out_of_time or (give_up is None and attempt >= retries):
                break
            if isinstance(err, NoRespondersError):
                await asyncio.sleep(min(timeout, 1.0, 0.05 * 2**attempt))
            continue
        try:
            return decode(CommandReply, msg.data)
        except MessageError as err:
            raise CommandFailed(f"{command.op} to {command.machine}: bad reply: {err}") from err
    raise CommandFailed(
        f"{command.op} to {command.machine}: no reply after {attempt} attempts ({last})"
    )


Handler = Callable[[Command], Awaitable[dict[str, Any]]]


class CommandServer:
    """Answers Commands for one machine; a command id seen before gets its first reply.

    `handler` returns the result dict, or raises to reply ok=False with the reason.
    Malformed commands are answered with an error and dead-lettered.
    """

    def __init__(
        self,
        nc: NatsClient,
        job: str,
        machine: str,
        handler: Handler,
        service: str = "sidecar",
        remember: int = 4096,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._job = job
        self._machine = machine
        self._handler = handler
        self._service = service
        self._replies: OrderedDict[str, asyncio.Future[CommandReply]] = OrderedDict()
        self._remember = remember
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Subscribes; raises PermissionDenied when this user may not take the commands."""
        self._sub = await subscribe(
            self._nc, JobSubjects(self._job).command(self._machine), cb=self._on_msg
        )

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for task in list(self._tasks):
            task.cancel()

    async def _on_msg(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one at a time: hand each command to
        # its own task so a slow command does not hold up the others.
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        try:
            if len(msg.data) > MAX_PAYLOAD:
                raise MessageError(f"payload of {len(msg.data)} bytes exceeds {MAX_PAYLOAD}")
            command = decode(Command, msg.data)
            if command.job != self._job or command.machine != self._machine:
                # Only this machine's commands come here; one naming another is forged
                # or misrouted, and running it would act on the wrong machine.
                raise MessageError(
                    f"command names {command.job}/{command.machine} but came on {msg.subject}"
                )
        except MessageError as err:
            await dead_letter(self._js, self._job, msg.subject, msg.data, str(err), self._service)
            if msg.reply:
                await msg.respond(CommandReply(command_id="", ok=False, error=str(err)).to_json())
            return
        fut = self._replies.get(command.command_id)
        if fut is None:
            # First sight of this id: run it once; a retry arriving while it runs waits
            # for the same future instead of running it again.
            fut = asyncio.get_running_loop().create_future()
            self._replies[command.command_id] = fut
            while len(self._replies) > self._remember:
                self._replies.popitem(last=False)
            fut.set_result(await self._run(command))
        reply = await fut
        if msg.reply:
            await msg.respond(reply.to_json())

    async def _run(self, command: Command) -> CommandReply:
        try:
            result = await self._handler(command)
            return CommandReply(command_id=command.command_id, ok=True, result=result)
        except Exception as err:
            log.warning(
                "command_failed",
                job=command.job,
                machine=command.machine,
                op=command.op,
                plan_id=command.plan_id,
                error=str(err),
            )
            return CommandReply(
                command_id=command.command_id, ok=False, error=f"{type(err).__name__}: {err}"
            )
