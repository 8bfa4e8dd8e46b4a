"""Bus helpers over nats-py: connect, job resources, durable publish, commands, dead letters.

- `connect` probes the server first, so an unreachable URL is one clear error instead of
  nats-py's long silent retry loop, then keeps reconnecting once connected.
- `ensure_job` creates the job's streams and key-value bucket idempotently (file
  storage, so they survive a server restart; replicated across a cluster, see
  trainmover.replication, which also creates a service's own buckets).
- `publish_durable` publishes to JetStream and waits for the ack; the message id becomes
  `Nats-Msg-Id`, so a retried publish is stored once.
- `request` sends a Command and retries on timeout with the same `command_id`;
  `CommandServer` answers them and replays the reply for a command it already ran.
- `dead_letter` records rejected input with its raw payload and reason.

Credentials: `connect` presents the caller's `NatsAuth` (by default the process's, from
the CLI flags or $TRAINMOVER_NATS_*; see trainmover.security.credentials) and, when
credentials are configured, refuses a server that does not check them. A publish or
subscribe the server's permissions refuse raises PermissionDenied from these helpers
instead of timing out (trainmover.security.denials).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import AuthorizationError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import PubAck, StorageType
from nats.js.errors import NoStreamResponseError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from trainmover import replication
from trainmover.logs import get_logger
from trainmover.messages import (
    MAX_MESSAGE_BYTES,
    Command,
    CommandReply,
    DeadLetter,
    Message,
    MessageError,
    decode,
)
from trainmover.natsserver import port_open
from trainmover.security import credentials, denials
from trainmover.security.credentials import NatsAuth
from trainmover.security.denials import PermissionDenied
from trainmover.subjects import JobSubjects

__all__ = ["PermissionDenied"]

log = get_logger("bus")
T = TypeVar("T")

MAX_PAYLOAD = MAX_MESSAGE_BYTES
"""Largest message any service accepts (bytes); larger input is dead-lettered."""

DEAD_LETTER_KEEP = 64 * 1024
"""Bytes of a rejected payload kept in its dead letter: the letter itself must fit in
MAX_PAYLOAD (base64 grows it by a third), and the head is what shows the problem."""

DUPLICATE_WINDOW_S = 300.0


class BusUnreachable(ConnectionError):
    """No NATS server answers at the given URL."""


class BusAuthFailed(BusUnreachable):
    """The server refused the credentials (wrong password, unknown user or NKey)."""


class BusNotAuthenticated(BusUnreachable):
    """Credentials are required or configured, but the server does not check them."""


class CommandFailed(RuntimeError):
    """A command got no reply after its retries, or the reply said it failed."""


def _servers(url: str) -> list[tuple[str, int]]:
    out = []
    for part in url.split(","):
        parsed = urlparse(part.strip() if "://" in part else f"nats://{part.strip()}")
        if not parsed.hostname:
            raise BusUnreachable(f"invalid NATS URL {part!r}")
        out.append((parsed.hostname, parsed.port or 4222))
    return out


def _url_auth(url: str) -> NatsAuth | None:
    """Credentials written into the URL (nats://user:password@host), if any."""
    for part in url.split(","):
        parsed = urlparse(part.strip() if "://" in part else f"nats://{part.strip()}")
        if parsed.username:
            password = unquote(parsed.password) if parsed.password is not None else None
            if password is None:  # nats://TOKEN@host
                return NatsAuth(token=unquote(parsed.username), source="the NATS URL")
            return NatsAuth(user=unquote(parsed.username), password=password, source="the NATS URL")
    return None


def _redact_url(url: str) -> str:
    from trainmover.logs import redact_text

    return redact_text(url)


def _is_auth_error(err: Exception) -> bool:
    # During the first connect nats-py reports a refusal as a plain Error with the
    # server's text; later as AuthorizationError.
    return isinstance(err, AuthorizationError) or "authorization violation" in str(err).lower()


def resolve_auth(
    url: str,
    auth: NatsAuth | None,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
) -> NatsAuth:
    """The credentials a connection presents: explicit ones, else the URL's, else the
    process default (CLI flags or $TRAINMOVER_NATS_*)."""
    if auth is not None:
        return auth
    if user or token:
        return NatsAuth(user=user, password=password, token=token, source="arguments")
    fallback = credentials.default()
    from_url = _url_auth(url)
    if from_url is not None:
        # The URL names who connects; TLS and require-auth still come from the settings.
        return replace(
            from_url,
            tls_ca=fallback.tls_ca,
            tls_cert=fallback.tls_cert,
            tls_key=fallback.tls_key,
            require_auth=fallback.require_auth,
        )
    return fallback


async def connect(
    url: str,
    name: str,
    *,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
    auth: NatsAuth | None = None,
    max_reconnect_attempts: int = -1,
) -> NatsClient:
    """Connects to NATS at `url` (comma-separated for a cluster), or raises BusUnreachable.

    Presents `auth` (default: `resolve_auth`). Raises BusAuthFailed when the server
    refuses the credentials, and BusNotAuthenticated when credentials are configured
    (or required) but the server lets anyone in.
    """
    servers = _servers(url)
    shown = _redact_url(url)
    auth = resolve_auth(url, auth, user, password, token)
    if auth.require_auth and not auth.configured:
        raise BusNotAuthenticated(
            f"{name}: authentication is required but no NATS credentials are configured "
            "(set TRAINMOVER_NATS_CREDS or pass --nats-creds)"
        )
    options = auth.connect_options()  # CredentialsError (bad TLS files) before any I/O
    reachable = await asyncio.gather(
        *(asyncio.to_thread(port_open, host, port, 1.0) for host, port in servers)
    )
    if not any(reachable):
        raise BusUnreachable(f"cannot reach NATS at {shown}: nothing listens there")
    refused = denials.Denials(auth.user or "")

    connecting = True
    fatal: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    async def on_error(err: Exception) -> None:
        if connecting and (_is_auth_error(err) or isinstance(err, ssl.SSLError)):
            # nats-py would retry refused credentials or an untrusted certificate
            # forever (max_reconnect_attempts also bounds the first connect); neither
            # gets better by retrying, so give up at the first one.
            if not fatal.done():
                fatal.set_result(err)
            return
        violation = refused.report(err)
        if violation is not None:
            log.warning(
                "nats_permission_denied",
                client=name,
                action=violation.action,
                subject=violation.subject,
            )
            return
        log.warning("nats_error", client=name, error=str(err))

    async def on_disconnect() -> None:
        if nc.is_closed or nc.is_draining:
            log.debug("nats_closed", client=name)  # our own close: nothing to warn about
        else:
            log.warning("nats_disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", client=name)

    scheme = "tls" if auth.tls else "nats"
    options["reconnect_time_wait"] = 0.2  # seconds; nats-py annotates it as int
    nc = NatsClient()
    attempt = asyncio.ensure_future(
        nc.connect(
            servers=[f"{scheme}://{h}:{p}" for h, p in servers],
            name=name,
            **options,
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=max_reconnect_attempts,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    )
    try:
        racing: set[asyncio.Future[Any]] = {attempt, fatal}
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if not attempt.done():
            attempt.cancel()
            with contextlib.suppress(BaseException):
                await attempt
            with contextlib.suppress(Exception):
                await nc.close()
            raise fatal.result()
        attempt.result()
    except ssl.SSLError as err:
        raise BusUnreachable(
            f"TLS with NATS at {shown} failed ({auth.describe()}): {err}"
        ) from None
    except Exception as err:  # nats-py raises several unrelated types here
        if _is_auth_error(err):
            raise BusAuthFailed(
                f"NATS at {shown} refused the credentials of {name} ({auth.describe()}): "
                "authorization violation (wrong password or unknown user?)"
            ) from None
        raise BusUnreachable(f"cannot connect to NATS at {shown}: {err}") from err
    finally:
        connecting = False
        if not fatal.done():
            fatal.cancel()
    denials.adopt(nc, refused)
    if (auth.configured or auth.require_auth) and not nc._server_info.get("auth_required"):
        await nc.close()
        raise BusNotAuthenticated(
            f"{name}: refusing the NATS server at {shown}: it accepts unauthenticated "
            f"connections, but credentials are configured ({auth.describe()}); start it with "
            "its authorization config (trainmover auth generate) or unset the credentials"
        )
    log.info("nats_connected", client=name, url=shown, auth=auth.describe())
    return nc


async def publish(nc: NatsClient, subject: str, data: bytes) -> None:
    """A plain (non-JetStream) publish that raises PermissionDenied if the server
    refuses it. Costs a round trip: use it where a refusal must not go unnoticed."""
    refused = denials.of(nc)
    mark = refused.count
    await nc.publish(subject, data)
    await _round_trip(nc)
    _raise_new(refused, mark, "publish", subject)


async def subscribe(nc: NatsClient, subject: str, **kwargs: Any) -> Any:
    """`nc.subscribe` that raises PermissionDenied if the server refuses it."""
    refused = denials.of(nc)
    mark = refused.count
    sub = await nc.subscribe(subject, **kwargs)
    await _round_trip(nc)
    try:
        _raise_new(refused, mark, "subscribe", subject)
    except PermissionDenied:
        await sub.unsubscribe()
        raise
    return sub


async def _round_trip(nc: NatsClient) -> None:
    """Returns once the server has processed everything sent so far (and so has sent
    any -ERR about it). nats-py writes a flush's PING straight to the socket, ahead of
    commands still queued for its flusher task; the first flush gets those written,
    the second PING then follows them on the wire, and its PONG follows their errors."""
    await nc.flush()
    await nc.flush()


def _raise_new(refused: denials.Denials, mark: int, action: str, subject: str) -> None:
    for violation in refused.since(mark):
        if violation.action == action and violation.subject == subject.lower():
            raise refused.error(denials.Violation(action, subject))


async def ensure_job(js: JetStreamContext, job: str) -> KeyValue:
    """Creates the job's streams and state bucket if missing; returns the bucket."""
    return await denials.of(js._nc).guard(_ensure_job(js, job), ["$JS.API.>"])


async def _ensure_job(js: JetStreamContext, job: str) -> KeyValue:
    subjects = JobSubjects(job)
    want = replication.replicas(js._nc)
    for stream, subs in subjects.streams.items():
        config: dict[str, Any] = dict(
            name=stream,
            subjects=subs,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            max_msg_size=MAX_PAYLOAD,
        )
        info = await replication.found_or_created(
            stream,
            want,
            lambda name=stream: js.stream_info(name),  # type: ignore[misc]
            lambda c=config: js.add_stream(num_replicas=want, **c),  # type: ignore[misc]
            NotFoundError,
        )
        if info is None:
            continue
        have = info.config
        if (sorted(have.subjects or []), have.duplicate_window, have.max_msg_size) != (
            sorted(subs),
            DUPLICATE_WINDOW_S,
            MAX_PAYLOAD,
        ):
            # Only when it differs: an update of a stream another service is creating
            # right now waits until that is done. Its replicas are kept here (a config
            # without them would mean 1) and raised below.
            await js.update_stream(num_replicas=have.num_replicas or 1, **config)
        await replication.ensure(js, stream, want)
    return await _job_bucket(js, job, create=True)


async def job_bucket(js: JetStreamContext, job: str, create: bool = False) -> KeyValue:
    """The job's cluster-state bucket; raises BucketNotFoundError unless `create`."""
    return await denials.of(js._nc).guard(_job_bucket(js, job, create), ["$JS.API.>"])


async def _job_bucket(js: JetStreamContext, job: str, create: bool = False) -> KeyValue:
    bucket = JobSubjects(job).bucket
    if not create:
        return await js.key_value(bucket)
    return await replication.key_value(js, bucket, history=16)


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
    while True:
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except (TimeoutError, NatsTimeout):
            continue
        except Exception as err:
            log.warning("fetch_failed", job=job, consumer=consumer, error=str(err))
            await asyncio.sleep(0.2)
            continue
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


async def through_failover(
    write: Callable[[], Awaitable[T]], what: str, deadline_s: float = FAILOVER_S
) -> T:
    """Runs the idempotent `write` (a key-value put, a deduplicated publish), again while
    the stream has no leader or its answer was lost (a server of the cluster died), for
    up to `deadline_s`; then raises the last error."""
    give_up = time.monotonic() + deadline_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return await write()
        except BUS_FAILOVER_ERRORS as err:
            if time.monotonic() >= give_up:
                raise
            log.info("write_retry", what=what, attempt=attempt, error=repr(err))
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
                await asyncio.sleep(min(0.1 * attempt, 0.5))


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
