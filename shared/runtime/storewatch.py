"""A store replica's death, seen the moment its process goes, without a c10d operation.

An operation of a c10d TCPStore client whose server died fails through c10d's error
path, which names the socket's two ends with getnameinfo(3): a reverse name lookup of
the IPv4-mapped address c10d's client sockets use, which the hosts file does not list
(`trainmover.runtime.tcpstore`). When the serving replica goes, every operation in
flight in every process takes that path at once; a resolver that drops one query of the
burst keeps that operation, and the rank waiting on it, for glibc's 5 s timeout.

So a process that uses a replica also holds a `Vigil` on it: a plain TCP connection that
never sends a byte (the store's server holds it as a client that has not spoken yet),
watched by one selector thread per process. The kernel ends that connection when the
server's process dies, and the vigil's `ended` future resolves then: a caller waiting
on an operation can leave it (`storeclient`) while the operation's own thread waits out
c10d's lookup (`unless_ended`), and a look at the replica knows it is gone without
asking c10d.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from trainmover.runtime import inflight
from trainmover.runtime.storegate import local_end

T = TypeVar("T")

#: How long the vigil's connection may take (a dead process refuses at once).
CONNECT_S = 0.5


class Vigil:
    """Watches one replica's server until it dies or the vigil is closed: `ended`
    resolves in either case (at once when nothing listens there)."""

    def __init__(self, host: str, port: int, gated: bool = True):
        self.host, self.port = host, port
        self.ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._sock: socket.socket | None = None
        try:
            at = local_end(host, port) if gated else (host, port)
            self._sock = socket.create_connection(at, timeout=CONNECT_S)
        except OSError:
            self.ended.set_result(None)
            return
        self._sock.setblocking(False)
        self._watcher = _WATCHER  # a forked child's own watcher knows none of these
        self._watcher.add(self)

    @property
    def alive(self) -> bool:
        return not self.ended.done()

    def _end(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        try:
            self.ended.set_result(None)
        except concurrent.futures.InvalidStateError:
            pass  # ended already

    def close(self) -> None:
        """Stops watching (this process is done with the replica)."""
        if self._sock is None:
            self._end()
        else:
            self._watcher.remove(self)


class _Watcher:
    """One thread that waits on every vigil's connection of this process."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

    def add(self, vigil: Vigil) -> None:
        with self._lock:
            assert vigil._sock is not None
            self._selector.register(vigil._sock, selectors.EVENT_READ, vigil)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="store-vigil", daemon=True)
                self._thread.start()

    def remove(self, vigil: Vigil) -> None:
        with self._lock:
            if vigil._sock is not None and vigil._sock in self._selector.get_map():
                self._selector.unregister(vigil._sock)
            vigil._end()
        self._wake_w.send(b"\0")  # the selector may be waiting on that socket

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                vigil = key.data
                if vigil is None:
                    self._wake_r.recv(4096)
                    continue
                try:
                    data = key.fileobj.recv(4096)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the server's end closed: its process went
                    with self._lock:
                        if vigil._sock is not None:
                            self._selector.unregister(vigil._sock)
                        vigil._end()


_WATCHER = _Watcher()


class ReplicaEnded(dist.DistNetworkError):
    """The replica an operation was sent to died (or was left) before it answered."""


def unless_ended(
    call: Callable[[], T], ended: concurrent.futures.Future[None], blocking: bool = True
) -> T:
    """`call()`'s result; ReplicaEnded as soon as `ended` resolves first. A `blocking`
    call (one that waits on the store: a get, a wait) runs on a helper thread, which
    waits out c10d's error path on its own; any other is a round trip of microseconds,
    run here unless its replica has ended already."""
    if ended.done():
        raise ReplicaEnded("the store replica had ended before the operation")
    if not blocking:
        return call()
    result: concurrent.futures.Future[T] = concurrent.futures.Future()
    _runner().submit(call, result)
    either: list[concurrent.futures.Future[Any]] = [result, ended]
    concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
    if result.done():  # an answer that came with the end still counts
        return result.result()
    raise ReplicaEnded("the store replica died with the operation in flight")


class _Runner:
    """A helper thread that runs one call at a time, then waits for the next."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._calls = queue.SimpleQueue()
        threading.Thread(target=self._run, name="store-op", daemon=True).start()

    def submit(self, call: Callable[[], Any], result: concurrent.futures.Future[Any]) -> None:
        self._calls.put((call, result))

    def _run(self) -> None:
        while True:
            call, result = self._calls.get()
            try:
                with inflight.inside():
                    answer = call()
                result.set_result(answer)
            except BaseException as err:  # handed to the caller, raised there
                result.set_exception(err)
            with _IDLE_LOCK:
                _IDLE.append(self)


_IDLE: list[_Runner] = []
_IDLE_LOCK = threading.Lock()


def _runner() -> _Runner:
    with _IDLE_LOCK:
        if _IDLE:
            return _IDLE.pop()
    return _Runner()


def _after_fork() -> None:
    """A forked child has none of its parent's threads."""
    global _WATCHER
    _IDLE.clear()
    _WATCHER = _Watcher()


os.register_at_fork(after_in_child=_after_fork)
