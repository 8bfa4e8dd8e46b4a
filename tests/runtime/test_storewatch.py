"""A replica's death seen without a c10d operation: a vigil on a store server in another
process ends when that process is killed, and a caller waiting on an operation there
leaves it at once while the operation itself is still blocked; a look at a replica seen to
die does not wait on its successor before that answers."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from trainmover.freeports import free_ports
from trainmover.runtime.storelook import ANSWER_S, SERVING, Look
from trainmover.runtime.storewatch import ReplicaEnded, Vigil, unless_ended

pytestmark = pytest.mark.timeout(60)

_SERVER = (
    "import sys, time; from trainmover.runtime.tcpstore import serve; "
    "s = serve('127.0.0.1', 0); print(s.port, flush=True); time.sleep(600)"
)


@contextlib.contextmanager
def _server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A store server in a process of its own, and its port."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        yield server, int(server.stdout.readline())
    finally:
        server.kill()
        server.wait()


def test_a_vigil_ends_when_its_servers_process_is_killed() -> None:
    with _server() as (server, port):
        vigil = Vigil("127.0.0.1", port, gated=False)
        assert vigil.alive
        with pytest.raises(concurrent.futures.TimeoutError):
            vigil.ended.result(timeout=0.5)  # a live server keeps it open
        server.send_signal(signal.SIGKILL)
        vigil.ended.result(timeout=10)
        assert not vigil.alive


def test_a_vigil_on_nothing_has_ended_at_once() -> None:
    (port,) = free_ports(1)
    assert not Vigil("127.0.0.1", port, gated=False).alive


def test_a_blocked_operation_is_left_when_its_replica_ends() -> None:
    release = threading.Event()
    ended: concurrent.futures.Future[None] = concurrent.futures.Future()
    threading.Timer(0.2, ended.set_result, (None,)).start()
    with pytest.raises(ReplicaEnded):
        unless_ended(release.wait, ended)  # the call itself never returns on its own
    assert not release.is_set()
    release.set()


def test_an_answered_operation_returns_its_value() -> None:
    ended: concurrent.futures.Future[None] = concurrent.futures.Future()
    assert unless_ended(lambda: 7, ended) == 7
    assert unless_ended(lambda: 8, ended, blocking=False) == 8
    ended.set_result(None)
    with pytest.raises(ReplicaEnded):
        unless_ended(lambda: 9, ended, blocking=False)  # not sent to a replica that went


def test_a_replica_that_died_and_listens_again_unanswering_is_not_taken_to_serve() -> None:
    with _server() as (server, port):
        look = Look("127.0.0.1", port, plain=True)
        assert look.look() == (SERVING, "")
        server.send_signal(signal.SIGKILL)
        server.wait()
        # Its successor listens and has not answered yet: a new process, which cannot
        # serve before it has (a standby waiting on it would put off its takeover).
        mute = socket.create_server(("127.0.0.1", port))
        try:
            began = time.monotonic()
            assert look.look() is None
            assert time.monotonic() - began < ANSWER_S
        finally:
            mute.close()
