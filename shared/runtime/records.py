"""Where shadow-iteration recordings live: a directory, or a NATS JetStream object store.

A live rank records what it receives during `runtime.record_step`; a standby's sandbox
replays it. The directory store (`sandbox.DirectoryRecordStore`) needs storage both can
see; the object store only needs the bus, which every machine of a job already reaches,
so a standby on a fresh host replays what a live rank recorded elsewhere.

`runtime.record_store` chooses: empty (the directory `runtime.record_dir`, default
`<run_dir>/records`) or a NATS URL (``nats://host:port``, comma-separated for a cluster;
credentials as for every bus client: $TRAINMOVER_NATS_*), whose bucket is
`TM_<job>_RECORDS` (`JobSubjects.records_bucket`). With bus authorization, a sidecar's
credentials grant its job's bucket (`security.policy`); a refusal raises
`bus.PermissionDenied`.

Workers are synchronous torch processes, and a nats-py client belongs to the event loop
it was created on; so the NATS store owns one loop in a daemon thread, connects lazily
on first use (a rank that never records or replays never connects), and each call hands
a coroutine to that loop and blocks on its result.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from nats import errors as nats_errors
from nats.aio.client import Client as NatsClient
from nats.js.errors import (
    NotFoundError,
    ObjectDeletedError,
    ObjectNotFoundError,
)
from nats.js.object_store import ObjectStore

from trainmover import bus, replication
from trainmover.runtime.config import NATS_SCHEMES, JobConfig
from trainmover.runtime.sandbox import DirectoryRecordStore, RecordStore
from trainmover.security import denials
from trainmover.security.credentials import NatsAuth
from trainmover.subjects import JobSubjects, obj_subjects

T = TypeVar("T")


class NatsRecordStore:
    """Recordings as objects of a JetStream object-store bucket (file storage), one per
    key; a put replaces the object of that name."""

    def __init__(
        self,
        url: str,
        bucket: str,
        client_name: str,
        timeout_s: float = 60.0,
        auth: NatsAuth | None = None,
    ):
        """`auth`: the credentials to present (default: $TRAINMOVER_NATS_*)."""
        self.url, self.bucket, self.client_name = url, bucket, client_name
        self.auth = auth
        self.timeout_s = timeout_s
        self._nc: NatsClient | None = None
        self._store: ObjectStore | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="record-store", daemon=True
        )
        self._thread.start()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("the record store is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout_s)

    async def _objects(self) -> ObjectStore:
        if self._store is None:
            assert self._nc is not None  # connected by _guarded
            js = self._nc.jetstream()
            self._store = await replication.object_store(js, self.bucket)
        return self._store

    async def _put(self, key: str, data: bytes) -> None:
        await (await self._objects()).put(key, data)

    async def _get(self, key: str) -> bytes | None:
        try:
            result = await (await self._objects()).get(key)
        except (ObjectNotFoundError, ObjectDeletedError):
            return None
        return result.data

    async def _size(self) -> int:
        try:
            infos = await (await self._objects()).list(ignore_deletes=True)
        except NotFoundError:  # nats-py's answer for an empty bucket
            return 0
        return sum(info.size or 0 for info in infos if not info.deleted)

    async def _guarded(self, work: Callable[[], Coroutine[Any, Any, T]], wait: bool = False) -> T:
        """`work`, raising PermissionDenied as soon as the server refuses one of its
        JetStream calls or object publishes (nats-py alone would wait for a timeout).
        With `wait`, a JetStream that does not answer for a while, or answers that it is
        unavailable (a stream electing its leader, a server of the cluster restarting),
        is waited out within the call's time: a standby's read, which no training waits
        for, that would otherwise leave it cold."""
        if self._nc is None:
            self._nc = await bus.connect(self.url, self.client_name, auth=self.auth)
        subjects = ["$JS.API.>", *obj_subjects(self.bucket)]
        deadline = time.monotonic() + 0.8 * self.timeout_s
        pause = 0.25
        while True:
            try:
                return await denials.of(self._nc).guard(work(), subjects)
            except (*bus.BUS_FAILOVER_ERRORS, nats_errors.NoRespondersError):
                if not wait or time.monotonic() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, 2.0)

    def put(self, key: str, data: bytes) -> None:
        self._run(self._guarded(lambda: self._put(key, data)))

    def reconnecting(self) -> bool:
        """Whether the connection lost its server and is trying to get one back."""
        return self._nc is not None and self._nc.is_reconnecting

    def get(self, key: str) -> bytes | None:
        return self._run(self._guarded(lambda: self._get(key), wait=True))

    def size_bytes(self) -> int:
        """Bytes of the recordings themselves (not JetStream's chunk overhead)."""
        return self._run(self._guarded(self._size))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._nc is not None:
            try:
                self._run(self._nc.close())
            except Exception:  # closing a dead connection: nothing left to release
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout_s)
        self._loop.close()


def open_record_store(config: JobConfig, run_dir: Path, client_name: str) -> RecordStore:
    """The record store `config.runtime` names (see the module docstring)."""
    rt = config.runtime
    if rt.record_store.startswith(NATS_SCHEMES):
        return NatsRecordStore(rt.record_store, JobSubjects(config.job).records_bucket, client_name)
    return DirectoryRecordStore(Path(rt.record_dir) if rt.record_dir else run_dir / "records")
