"""How many copies the bus keeps of each stream, key-value bucket and object store.

Default: what the server reports. A server in a cluster (its INFO names a `cluster`)
gets `CLUSTER_REPLICAS` copies, so losing any one server loses nothing and leaves a
quorum; a standalone or embedded server gets 1 (it has nowhere to put more).
$TRAINMOVER_NATS_REPLICAS (or `trainmover --nats-replicas N`) overrides it.

A resource that already exists with fewer replicas than wanted is scaled up in place
(JetStream copies its data to the new peers); one the server cannot scale raises
ReplicationError naming the stream, what it has and what was asked. A resource with more
replicas than wanted is left as it is: nothing here ever lowers durability.

`key_value` and `object_store` open a service's bucket or object store that way
(created with file storage if missing); bus.ensure_job does it for the job's streams.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client as NatsClient
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import BadRequestError, BucketNotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from trainmover.logs import get_logger

log = get_logger("bus")
T = TypeVar("T")

REPLICAS_ENV = "TRAINMOVER_NATS_REPLICAS"
CLUSTER_REPLICAS = 3
MAX_REPLICAS = 5
"""JetStream's own limit on a stream's replicas."""


class ReplicationError(RuntimeError):
    """A stream cannot get the replicas asked for (bad setting, too few servers)."""


def configured(env: dict[str, str] | None = None) -> int | None:
    """The replica count set in the environment, or None; ReplicationError if invalid."""
    raw = (os.environ if env is None else env).get(REPLICAS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_REPLICAS:
        raise ReplicationError(
            f"{REPLICAS_ENV}={raw!r}: a replica count is a whole number from 1 to {MAX_REPLICAS}"
        )
    return value


def replicas(nc: NatsClient) -> int:
    """The replica count for resources created through `nc`: the setting, else 3 on a
    clustered server and 1 on a standalone one."""
    setting = configured()
    if setting is not None:
        return setting
    return CLUSTER_REPLICAS if server_cluster(nc) else 1


def server_cluster(nc: NatsClient) -> str | None:
    """The name of the cluster the connected server belongs to (None: standalone)."""
    info: dict[str, Any] = getattr(nc, "_server_info", None) or {}
    return info.get("cluster") or None


async def ensure(js: JetStreamContext, stream: str, want: int) -> int:
    """Scales `stream` (a stream, or a bucket's `KV_`/`OBJ_` stream) up to `want`
    replicas if it has fewer; returns the replicas it has afterwards."""
    info = await js.stream_info(stream)
    have = info.config.num_replicas or 1
    if have >= want:
        return have
    info.config.num_replicas = want
    try:
        await js.update_stream(info.config)
    except Exception as err:
        raise ReplicationError(scale_refused(stream, have, want, err)) from err
    log.warning("stream_replicas_raised", stream=stream, replicas_before=have, replicas=want)
    return want


def scale_refused(stream: str, have: int, want: int, err: Exception) -> str:
    """The message of a stream the server would not give `want` replicas."""
    return (
        f"stream {stream} has {have} replica(s) but {want} are wanted "
        f"(set {REPLICAS_ENV} to change that); the server refused: {err}"
    )


async def create(stream: str, want: int, creating: Awaitable[Any]) -> Any:
    """Awaits the creation of `stream`; a refusal of its replicas says so."""
    try:
        return await creating
    except Exception as err:
        text = str(err).lower()
        if want > 1 and ("insufficient resources" in text or "non-clustered" in text):
            raise ReplicationError(
                f"cannot create {stream} with {want} replicas: a standalone server keeps "
                f"1 and a cluster needs {want} JetStream servers up "
                f"(set {REPLICAS_ENV} to change it): {err}"
            ) from err
        raise


CREATE_ATTEMPTS = 5
NO_PLACEMENT = 10005
"""JetStream's "no suitable peers for placement": a server not (yet, or no longer) seen
online by the meta leader, as right after a cluster forms on a loaded host."""
PLACEMENT_BACKOFF_S = 0.5


async def found_or_created(
    stream: str,
    want: int,
    existing: Callable[[], Awaitable[T]],
    created: Callable[[], Awaitable[Any]],
    missing: type[Exception],
) -> T | None:
    """`existing()`, or None once `created()` made it (`existing` raising `missing`).

    Two processes creating the same replicated stream at once (the services of a job
    starting together) can each see their request go unanswered while the cluster
    agrees on one: a timed-out creation looks again instead of failing. A creation
    refused for want of peers to place the replicas on is tried again after a growing
    pause (a server's presence reaches the meta leader late on a loaded host); there is
    no event to await for it."""
    for attempt in range(1, CREATE_ATTEMPTS + 1):
        try:
            try:
                return await existing()
            except missing:
                pass
            await create(stream, want, created())
            return None
        except (TimeoutError, NatsTimeout):
            log.info("stream_create_retry", stream=stream, attempt=attempt)
        except BadRequestError as err:
            if err.err_code != NO_PLACEMENT:
                raise
            if attempt == CREATE_ATTEMPTS:
                raise ReplicationError(
                    f"cannot create {stream} with {want} replicas: no peers to place them "
                    f"on after {CREATE_ATTEMPTS} attempts ({err})"
                ) from err
            log.info("stream_create_retry", stream=stream, attempt=attempt, reason=str(err))
            await asyncio.sleep(PLACEMENT_BACKOFF_S * attempt)
    raise ReplicationError(f"cannot create {stream}: {CREATE_ATTEMPTS} attempts timed out")


async def _open(
    js: JetStreamContext,
    stream: str,
    existing: Callable[[], Awaitable[T]],
    created: Callable[[int], Awaitable[T]],
) -> T:
    """`existing()` scaled up to the configured replicas, or, when the bucket is missing,
    `created(replicas)`."""
    want = replicas(js._nc)
    made: list[T] = []

    async def create_it() -> None:
        made.append(await created(want))

    found = await found_or_created(stream, want, existing, create_it, BucketNotFoundError)
    if found is None:
        # What the creation returned: looking the bucket up at once can miss it on a
        # cluster ("stream not found") until the new stream's replicas elected a leader.
        return made[-1]
    await ensure(js, stream, want)
    return found


async def key_value(js: JetStreamContext, bucket: str, history: int) -> KeyValue:
    """The key-value bucket `bucket`, created (file storage, the configured replicas)
    if missing, scaled up if it has fewer replicas than configured."""
    return await _open(
        js,
        f"KV_{bucket}",
        lambda: js.key_value(bucket),
        lambda n: js.create_key_value(
            bucket=bucket, history=history, storage=StorageType.FILE, replicas=n
        ),
    )


async def object_store(js: JetStreamContext, bucket: str) -> ObjectStore:
    """The object store `bucket`, created or scaled up as `key_value` does. Concurrent
    creators are fine: creating an identical stream is a no-op."""
    return await _open(
        js,
        f"OBJ_{bucket}",
        lambda: js.object_store(bucket),
        lambda n: js.create_object_store(bucket, storage=StorageType.FILE, replicas=n),
    )
