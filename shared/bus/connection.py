"""Connecting to NATS, and plain publish / subscribe that surface a permission refusal.

`connect` probes the server first, so an unreachable URL is one clear error instead of
nats-py's long silent retry loop, then keeps reconnecting once connected. It presents
the caller's `NatsAuth` (by default the process's, from the CLI flags or
$TRAINMOVER_NATS_*; see trainmover.security.credentials) and, when credentials are
configured, refuses a server that does not check them. `publish` and `subscribe` raise
PermissionDenied when the server's permissions refuse them, instead of timing out
(trainmover.security.denials).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import replace
from typing import Any
from urllib.parse import unquote, urlparse

from nats.aio.client import Client as NatsClient
from nats.errors import AuthorizationError

from trainmover.logs import get_logger
from trainmover.natsserver import port_open
from trainmover.security import credentials, denials
from trainmover.security.credentials import NatsAuth
from trainmover.security.denials import PermissionDenied

log = get_logger("bus")


class BusUnreachable(ConnectionError):
    """No NATS server answers at the given URL."""


class BusAuthFailed(BusUnreachable):
    """The server refused the credentials (wrong password, unknown user or NKey)."""


class BusNotAuthenticated(BusUnreachable):
    """Credentials are required or configured, but the server does not check them."""


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
