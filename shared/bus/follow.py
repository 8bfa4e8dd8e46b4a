"""Following one key of a JetStream key-value bucket through the loss of a server.

nats-py's `KeyValue.watch` is an ordered push consumer held by one server of a cluster,
with replicas of one. When that server dies the consumer goes with it, and nats-py only
notices after two missed idle heartbeats (10 s); if recreating it then fails (the
stream is still electing its leader) the next try is another 10 s later. A service
reading the cluster state that way acts on a state tens of seconds old: the health
monitor judges reports against it, the executor fences from it, a sidecar learns its
role from it.

`follow` yields every new value of the key in revision order, like a watch, and checks
the watch against a direct read of the key whenever it has been quiet for `check_s`:
a value newer than the watch delivered means the watch is dead, and it is opened again
(from the newest value; the key holds a whole state, so nothing between is needed). A
read that fails (no quorum yet) is tried again at the next check.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats import errors as nats_errors
from nats.js.kv import KeyValue

from trainmover.logs import get_logger

log = get_logger("bus")

#: How long a quiet watch goes before it is checked against a direct read of the key.
CHECK_S = 1.0


@dataclass(frozen=True)
class Value:
    """One value of the followed key."""

    revision: int
    value: bytes


def _value(entry: KeyValue.Entry) -> Value | None:
    """A put's value; None for the end of the initial values, a delete or a purge."""
    if entry is None or entry.value is None or entry.operation is not None:
        return None
    return Value(int(entry.revision or 0), entry.value)


async def follow(kv: KeyValue, key: str, check_s: float = CHECK_S) -> AsyncIterator[Value]:
    """Every value `key` takes from now on (first its current one), in revision order;
    deletes and purges are skipped (the last value stands)."""
    last = 0
    while True:
        try:
            watcher = await kv.watch(key)
        except nats_errors.Error as err:  # no quorum yet, a stream electing its leader
            log.warning("watch_open_failed", key=key, error=repr(err))
            newest = await _read(kv, key)
            if newest is not None and newest.revision > last:
                last = newest.revision
                yield newest
            await asyncio.sleep(check_s)
            continue
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=check_s)
                except nats_errors.TimeoutError:
                    newest = await _read(kv, key)
                    if newest is None or newest.revision <= last:
                        continue  # quiet, and nothing missed (or no answer yet)
                    log.warning("watch_stalled", key=key, revision=newest.revision, delivered=last)
                    last = newest.revision
                    yield newest
                    break  # open it again
                value = _value(entry)
                if value is None or value.revision <= last:
                    continue  # a marker or a delete, or delivered again by a reopened watch
                last = value.revision
                yield value
        finally:
            with contextlib.suppress(Exception):  # the consumer may be gone with its server
                await watcher.stop()


async def _read(kv: KeyValue, key: str) -> Value | None:
    """The key's newest value; None when it has none or the bucket does not answer."""
    try:
        entry = await kv.get(key)
    except nats_errors.Error:  # no value (KeyNotFoundError), or no answer yet
        return None
    return _value(entry)
