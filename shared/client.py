"""The async Python client: drain or fail a machine, read a job's state, follow migrations.

    async with await TrainMoverClient.connect("nats://127.0.0.1:4222") as tm:
        event_id = await tm.drain("job1", "m2", reason="driver update", deadline_s=600)
        done = await tm.wait_for_migration("job1", event_id, timeout=120)
        print(done.state, done.downtime_s)

Usable from any asyncio program; every public method is typed and raises a subclass of
TrainMoverError (or BusUnreachable, or bus.PermissionDenied when the bus's permissions
refuse this user, e.g. another job's events) with a one-line reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import BucketNotFoundError

from trainmover import bus
from trainmover.bus.clusterstate import read_state
from trainmover.logs import get_logger
from trainmover.messages import (
    TERMINAL_STATES,
    ClusterState,
    DrainEvent,
    FailureEvent,
    MessageError,
    MigrationProgress,
    RebalanceEvent,
    StragglerEvent,
    decode,
    decode_event,
)
from trainmover.natsserver import resolve_url
from trainmover.security import denials
from trainmover.security.credentials import NatsAuth
from trainmover.subjects import JobSubjects, check_name

Event = DrainEvent | FailureEvent | StragglerEvent | RebalanceEvent

log = get_logger("client")


class TrainMoverError(RuntimeError):
    """Base of the client's errors; the message is a one-line reason."""


class UnknownJob(TrainMoverError):
    pass


class UnknownMachine(TrainMoverError):
    pass


class MachineLeaving(TrainMoverError):
    """The machine is already leaving, failed or in maintenance."""


class MigrationTimeout(TrainMoverError):
    pass


class TrainMoverClient:
    """A connection to the bus, for operators' scripts, the CLI and tests."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._js = nc.jetstream()

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        *,
        name: str = "trainmover-client",
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        auth: NatsAuth | None = None,
    ) -> TrainMoverClient:
        """Connects to `url` (or $TRAINMOVER_NATS_URL); raises BusUnreachable.

        Credentials: `auth`, else user/password/token, else the process default
        (--nats-creds or $TRAINMOVER_NATS_CREDS, see trainmover.security.credentials).
        """
        resolved = resolve_url(url)
        if not resolved:
            raise TrainMoverError(
                "no NATS URL: pass --nats-url or set TRAINMOVER_NATS_URL "
                "(`trainmover up` prints it)"
            )
        nc = await bus.connect(resolved, name, user=user, password=password, token=token, auth=auth)
        return cls(nc)

    async def close(self) -> None:
        await self._nc.drain()

    async def __aenter__(self) -> TrainMoverClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- state -----------------------------------------------------------------------

    async def status(self, job: str) -> ClusterState:
        """The planner's current view of `job`; raises UnknownJob when there is none."""
        check_name("job", job)

        async def read() -> Any:
            bucket = await bus.job_bucket(self._js, job)
            return await denials.of(self._nc).guard(read_state(bucket), ["$JS.API.>"])

        try:
            state = await bus.through_failover(read, f"status of {job}")
        except BucketNotFoundError:
            state = None
        if state is None:
            raise UnknownJob(f"unknown job {job!r}: no planner has registered it")
        return state  # type: ignore[no-any-return]

    # --- events ----------------------------------------------------------------------

    async def drain(
        self, job: str, machine: str, reason: str = "", deadline_s: float | None = None
    ) -> str:
        """Asks for a planned migration of `machine`; returns the event id."""
        return await self.publish_event(
            DrainEvent(job=job, machine=machine, reason=reason, deadline_s=deadline_s)
        )

    async def report_failure(self, job: str, machine: str, reason: str = "") -> str:
        """Reports `machine` as failed (unplanned migration); returns the event id."""
        return await self.publish_event(FailureEvent(job=job, machine=machine, reason=reason))

    async def rebalance(self, job: str, machine: str | None = None, reason: str = "") -> str:
        """Asks to move `machine` (or the slowest one); returns the event id."""
        return await self.publish_event(RebalanceEvent(job=job, machine=machine, reason=reason))

    async def publish_event(self, event: Event) -> str:
        """Checks the machine against the job's state, then publishes `event` durably."""
        state = await self.status(event.job)
        if event.machine is not None:
            machine = state.machines.get(event.machine)
            if machine is None:
                raise UnknownMachine(
                    f"unknown machine {event.machine!r} in job {event.job!r} "
                    f"(known: {', '.join(sorted(state.machines)) or 'none'})"
                )
            if event.kind != "failure" and machine.status in ("leaving", "failed", "maintenance"):
                raise MachineLeaving(
                    f"machine {event.machine!r} is already {machine.status}: nothing to "
                    f"{event.kind}"
                )
            if event.kind != "failure" and any(q.machine == event.machine for q in state.queued):
                raise MachineLeaving(
                    f"machine {event.machine!r} is already queued to leave (waiting for a "
                    f"standby): nothing to {event.kind}"
                )
        # Long enough for a stream leader's election after a server of the cluster died;
        # an event published while the bus has no quorum is refused after it.
        await bus.publish_durable(
            self._js,
            JobSubjects(event.job).event(event.kind),
            event,
            msg_id=event.event_id,
            timeout=bus.FAILOVER_S,
        )
        log.info(
            "event_published",
            job=event.job,
            machine=event.machine,
            kind=event.kind,
            event_id=event.event_id,
        )
        return event.event_id

    # --- following migrations ----------------------------------------------------------

    async def migrations(self, job: str) -> list[MigrationProgress]:
        """The latest progress of every migration the bus still holds, oldest first: the
        in-flight ones in their current phase, the ended ones with their downtime. Read
        again when a server of the bus cluster went away meanwhile."""
        check_name("job", job)
        subjects = JobSubjects(job)

        async def read() -> list[MigrationProgress]:
            info = await self._js.stream_info(subjects.stream("PROGRESS"))
            last_seq = info.state.last_seq
            latest: dict[str, MigrationProgress] = {}
            if info.state.messages == 0:
                return []
            sub = await self._js.subscribe(
                subjects.progress,
                stream=subjects.stream("PROGRESS"),  # clients may not look streams up
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL,
            )
            try:
                while True:
                    msg = await sub.next_msg(timeout=5)
                    with contextlib.suppress(MessageError):
                        progress = decode(MigrationProgress, msg.data)
                        latest.pop(progress.event_id, None)  # re-insert: ordered by latest
                        latest[progress.event_id] = progress
                    if msg.metadata.sequence.stream >= last_seq:
                        break
            finally:
                await sub.unsubscribe()
            return list(latest.values())

        return await bus.through_failover(read, f"migrations of {job}")

    def watch(self, job: str, *, from_start: bool = False) -> Watch:
        """Follows the job's events and migration progress as they are published.

            async with tm.watch("job1") as items:
                async for item in items:   # DrainEvent, ..., MigrationProgress
                    ...

        The subscriptions exist once the `async with` is entered, so nothing published
        after that is missed. With `from_start`, first replays what the bus still holds.
        """
        return Watch(self, job, from_start)

    async def wait_for_migration(
        self, job: str, event_id: str, timeout: float = 120.0
    ) -> MigrationProgress:
        """Waits for the migration caused by `event_id` to end; returns its last progress.

        The returned state is one of TERMINAL_STATES (done, aborted, failed, rejected);
        raises MigrationTimeout when none comes within `timeout` seconds.
        """

        seen: list[MigrationProgress] = []

        async def terminal() -> MigrationProgress:
            while True:
                try:
                    async with self.watch(job, from_start=True) as items:
                        async for item in items:
                            if not isinstance(item, MigrationProgress) or item.event_id != event_id:
                                continue
                            if item.state in TERMINAL_STATES:
                                return item
                            seen.append(item)
                except bus.BUS_FAILOVER_ERRORS as err:
                    # A server of the cluster went away while the watch was set up: the
                    # migration is not late, the bus is electing; watch again.
                    log.info("watch_retry", job=job, event_id=event_id, error=repr(err))
                    await asyncio.sleep(0.2)

        try:
            return await asyncio.wait_for(terminal(), timeout)
        except TimeoutError:
            raise MigrationTimeout(
                f"migration for event {event_id} in job {job!r} did not finish in {timeout}s; "
                + _last_seen(seen)
            ) from None


class Watch:
    """An open subscription to a job's events and progress; see TrainMoverClient.watch."""

    def __init__(self, client: TrainMoverClient, job: str, from_start: bool) -> None:
        self._client = client
        self._job = job
        self._from_start = from_start
        self._queue: asyncio.Queue[Event | MigrationProgress] = asyncio.Queue()
        self._subs: list[Any] = []

    async def __aenter__(self) -> Watch:
        await self._client.status(self._job)  # UnknownJob before subscribing to nothing
        subjects = JobSubjects(self._job)
        policy = DeliverPolicy.ALL if self._from_start else DeliverPolicy.NEW
        self._subs = [
            await self._subscribe(subjects.events, subjects.stream("EVENTS"), decode_event, policy),
            await self._subscribe(
                subjects.progress,
                subjects.stream("PROGRESS"),
                lambda raw: decode(MigrationProgress, raw),
                policy,
            ),
        ]
        return self

    async def _subscribe(
        self,
        subject: str,
        stream: str,
        parse: Callable[[bytes], Event | MigrationProgress],
        policy: DeliverPolicy,
    ) -> Any:
        """An ordered consumer on `stream` (named, not looked up by subject: a client may
        not list streams), created through a failover: its creation is answered by the
        stream's leader, which a server restart in the cluster takes away for seconds."""
        js = self._client._js
        guard = denials.of(self._client._nc).guard

        async def create() -> Any:
            sub = js.subscribe(
                subject, stream=stream, cb=self._on(parse), ordered_consumer=True,
                deliver_policy=policy,
            )  # fmt: skip
            return await guard(sub, ["$JS.API.>", "_INBOX.>"])

        return await bus.through_failover(create, f"watch {subject}")

    def _on(
        self, parse: Callable[[bytes], Event | MigrationProgress]
    ) -> Callable[[Msg], Awaitable[None]]:
        async def deliver(msg: Msg) -> None:
            try:
                self._queue.put_nowait(parse(msg.data))
            except MessageError as err:
                log.warning(
                    "watch_skipped_invalid", job=self._job, subject=msg.subject, reason=str(err)
                )

        return deliver

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> Event | MigrationProgress:
        if not self._subs:
            raise StopAsyncIteration
        return await self._queue.get()


def _last_seen(seen: list[MigrationProgress]) -> str:
    """Where a late migration stands: its last progress (the state its executor is in)."""
    if not seen:
        return "no progress was published for it (is an executor running?)"
    last = seen[-1]
    return (
        f"its last progress: {last.state} of plan {last.plan_id} ({last.detail}), "
        f"{time.time() - last.ts:.0f}s ago"
    )
