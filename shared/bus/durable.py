"""Durable input and output over JetStream: consuming in order, publishing with an ack,
retrying writes through a stream's leader election, and dead letters.

- `pump` pulls a durable consumer forever; a message whose handling fails is
  redelivered and handled before any later one.
- `publish_durable` publishes and waits for the ack; the message id becomes
  `Nats-Msg-Id`, so a retried publish is stored once.
- `through_failover` retries an idempotent write while a stream has no leader.
- `dead_letter` records rejected input with its raw payload and reason.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from trainmover.logs import get_logger
from trainmover.messages import DeadLetter, Message
from trainmover.security import denials
from trainmover.subjects import JobSubjects

log = get_logger("bus")
T = TypeVar("T")

DEAD_LETTER_KEEP = 64 * 1024
"""Bytes of a rejected payload kept in its dead letter: the letter itself must fit in
MAX_PAYLOAD (base64 grows it by a third), and the head is what shows the problem."""


REDELIVERY_DELAY_S = 1.0
"""How long a message put back by `pump` waits before the bus sends it again."""

HOLD_MAX_S = 60.0
"""The longest `pump` holds later messages back behind one whose handling failed (twice
the consumers' 30 s ack wait: the failed one is back long before, unless it was lost)."""


class _Hold:
    """Stream sequences of the messages whose handling failed, while they are out.

    Later messages may already be buffered in the client (a fetch can return a batch in
    pieces), so putting back the rest of the failed batch is not enough to keep order:
    every later message is put back too until each failed one has been handled."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._out: dict[int, float] = {}  # stream sequence -> when its handling failed

    def fail(self, seq: int | None) -> None:
        if seq is not None:
            self._out.setdefault(seq, self._clock())

    def holds_back(self, seq: int | None) -> bool:
        if seq is None or not self._out:
            return False
        now = self._clock()
        for lost in [s for s, since in self._out.items() if now - since > HOLD_MAX_S]:
            log.warning("hold_released", held_seq=lost, reason="never redelivered")
            del self._out[lost]
        return any(out < seq for out in self._out)

    def handled(self, seq: int | None) -> None:
        if seq is not None:
            self._out.pop(seq, None)


def _stream_seq(msg: Msg) -> int | None:
    try:
        return msg.metadata.sequence.stream
    except Exception:  # not a JetStream message: nothing to order it by
        return None


class _FetchOutage:
    """Logs a consumer's failing fetches once per outage (its first error, then how long
    it lasted and how many failed), not once per retry: a stream's leader election
    fails fetches five times a second for as long as it takes."""

    def __init__(self, job: str, consumer: str, clock: Callable[[], float] = time.monotonic):
        self._job, self._consumer, self._clock = job, consumer, clock
        self._since: float | None = None
        self._failures = 0

    def failed(self, err: Exception) -> None:
        self._failures += 1
        if self._since is None:
            self._since = self._clock()
            log.warning("fetch_failed", job=self._job, consumer=self._consumer, error=str(err))
        else:
            log.debug("fetch_failed", job=self._job, consumer=self._consumer, error=str(err))

    def over(self) -> None:
        if self._since is not None:
            log.info(
                "fetch_recovered",
                job=self._job,
                consumer=self._consumer,
                failures=self._failures,
                after_s=round(self._clock() - self._since, 3),
            )
            self._since, self._failures = None, 0


async def pump(
    sub: Any,
    handle: Callable[[Msg], Awaitable[None]],
    *,
    job: str,
    consumer: str,
    batch: int = 16,
    recover: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Pulls the durable consumer `sub` forever, handing each message to `handle`, which
    acks it once handled. A failed fetch (the bus reconnecting) is retried. A message
    whose handling fails (the bus went away mid-decision) is not lost: after `recover()`
    it is redelivered and handled before any message that came after it."""
    hold = _Hold()
    outage = _FetchOutage(job, consumer)
    while True:
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except (TimeoutError, NatsTimeout):
            outage.over()
            continue
        except Exception as err:
            outage.failed(err)
            await asyncio.sleep(0.2)
            continue
        outage.over()
        for msg in msgs:
            seq = _stream_seq(msg)
            if hold.holds_back(seq):
                with contextlib.suppress(Exception):
                    await msg.nak(delay=REDELIVERY_DELAY_S)
                continue
            try:
                await handle(msg)
            except Exception as err:
                log.warning(
                    "input_retry",
                    job=job,
                    consumer=consumer,
                    subject=msg.subject,
                    seq=seq,
                    reason=f"handling failed, redelivering: {type(err).__name__}: {err}",
                )
                hold.fail(seq)
                await asyncio.sleep(0.5)
                if recover is not None:
                    try:
                        await recover()
                    except Exception as again:
                        log.warning("recover_failed", job=job, consumer=consumer, error=str(again))
                with contextlib.suppress(Exception):
                    await msg.nak(delay=REDELIVERY_DELAY_S)
                continue
            hold.handled(seq)


FAILOVER_S = 30.0
"""How long `through_failover` keeps retrying: a stream's leader election takes seconds."""


BUS_FAILOVER_ERRORS = (NatsTimeout, NoStreamResponseError, ServiceUnavailableError)
"""What a JetStream request raises while a stream's leader is being elected."""


ATTEMPT_S = 1.0
"""How long one attempt of a short write or read on the migration path may take: a
request sent to a server of the cluster that is catching up after its restart can go
unanswered for the client's whole timeout (5 s), while the same request sent again is
answered at once by another."""


async def through_failover(
    write: Callable[[], Awaitable[T]],
    what: str,
    deadline_s: float = FAILOVER_S,
    attempt_s: float | None = None,
) -> T:
    """Runs the idempotent `write` (a key-value put, a deduplicated publish, or a read),
    again while the stream has no leader or its answer was lost (a server of the cluster
    died), for up to `deadline_s`; then raises the last error. With `attempt_s`, an
    attempt not answered within it is given up and tried again (for requests that are
    small and answered within milliseconds when the bus is well)."""
    give_up = time.monotonic() + deadline_s
    attempt = 0
    while True:
        attempt += 1
        try:
            if attempt_s is None:
                return await write()
            return await asyncio.wait_for(write(), attempt_s)
        except (*BUS_FAILOVER_ERRORS, TimeoutError) as err:
            if time.monotonic() >= give_up:
                raise
            log.info("bus_retry", what=what, attempt=attempt, error=repr(err))
            await asyncio.sleep(min(0.1 * attempt, 1.0))


PUBLISH_ATTEMPT_S = 1.0
"""How long one attempt of a deduplicated `publish_durable` waits for its ack. When the
client fails over to another server of a cluster, the ack of a publish sent across the
switch can be lost; a new attempt with the same message id gets it (or its duplicate ack)."""


async def publish_durable(
    js: JetStreamContext,
    subject: str,
    message: Message,
    msg_id: str | None = None,
    timeout: float = 5.0,
) -> PubAck:
    """Publishes `message` to JetStream and waits for the ack.

    `msg_id` (e.g. the event id) deduplicates retries within the stream's window; with
    one, an attempt that gets no ack is retried until `timeout` has passed.
    """
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        left = deadline - time.monotonic()
        wait = min(PUBLISH_ATTEMPT_S, left) if msg_id else timeout
        try:
            return await denials.of(js._nc).guard(
                js.publish(subject, message.to_json(), timeout=wait, headers=headers), [subject]
            )
        except (NatsTimeout, NoStreamResponseError) as err:
            if msg_id is None or time.monotonic() + 0.01 >= deadline:
                raise
            log.info(
                "publish_retry", subject=subject, msg_id=msg_id, attempt=attempt, error=repr(err)
            )
            if isinstance(err, NoStreamResponseError):  # no stream leader yet: let it elect
                await asyncio.sleep(min(0.1 * attempt, 0.5, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise  # the last attempt's error, not a request sent with no time left


async def dead_letter(
    js: JetStreamContext, job: str, subject: str, payload: bytes, reason: str, service: str
) -> None:
    """Records rejected input on the job's dead-letter subject; never raises."""
    kept = payload[:DEAD_LETTER_KEEP]
    if len(payload) > DEAD_LETTER_KEEP:
        reason = f"{reason} [payload truncated to {DEAD_LETTER_KEEP} of {len(payload)} bytes]"
    try:
        text = kept.decode()
    except UnicodeDecodeError:
        text = "base64:" + base64.b64encode(kept).decode()
    reason = reason[:4096]
    letter = DeadLetter(job=job, subject=subject, reason=reason, payload=text, service=service)
    log.warning("input_rejected", job=job, subject=subject, reason=reason, service=service)
    try:
        await publish_durable(js, JobSubjects(job).deadletter, letter)
    except Exception as err:  # the rejection is already logged; losing the copy is not fatal
        log.error("dead_letter_failed", job=job, subject=subject, error=str(err))
