"""A job's JetStream resources: its streams and its cluster-state bucket.

`ensure_job` creates them idempotently (file storage, so they survive a server restart;
replicated across a cluster, see trainmover.replication, which also creates a service's
own buckets) and brings an older stream's settings up to date. `bucket_keys` lists a
bucket's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from trainmover import replication
from trainmover.bus.clusterstate import follow_states
from trainmover.bus.durable import through_failover
from trainmover.messages import MAX_MESSAGE_BYTES, ClusterState
from trainmover.security import denials
from trainmover.subjects import JobSubjects, kv_stream, kv_subjects

MAX_PAYLOAD = MAX_MESSAGE_BYTES
"""Largest message any service accepts (bytes); larger input is dead-lettered."""

DUPLICATE_WINDOW_S = 300.0
"""How long a stream remembers a message id, so that a retried publish is stored once."""


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


async def state_until(
    nc: NatsClient, job: str, predicate: Callable[[ClusterState], bool]
) -> ClusterState:
    """Until the job's cluster state satisfies `predicate`; returns that state. A watch
    that a server of the bus cluster took with it is set up again. Unbounded: the caller
    bounds it."""

    async def bucket() -> KeyValue:
        return await job_bucket(nc.jetstream(), job)

    kv = await through_failover(bucket, f"the state bucket of {job}")
    async for state in follow_states(kv):
        if predicate(state):
            return state
    raise AssertionError("a followed key never ends")  # pragma: no cover


async def bucket_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """The keys of `bucket` that hold a value or a delete marker, in one request that
    times out like any other. (nats-py's `KeyValue.keys` waits for the end marker of a
    watch, which a slow server can make it drop: then it waits for ever.) A key read
    after this may be gone: reads skip KeyNotFoundError."""
    prefix = kv_subjects(bucket)[:-1]
    info = await js.stream_info(kv_stream(bucket), subjects_filter=kv_subjects(bucket))
    return sorted(subject[len(prefix) :] for subject in info.state.subjects or {})
