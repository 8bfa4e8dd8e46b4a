"""The control connection: the control API's messages (`trainmover.runtime.control`) as
JSON lines over one local TCP socket per worker, either side sending requests (each
answered by exactly one reply) and events; and how a worker reaches its supervisor.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from trainmover.runtime.control import MESSAGES, Error, Message


class RemoteError(RuntimeError):
    """The other side answered a request with an error."""


RequestHandler = Callable[[Message], Message]
EventHandler = Callable[[Message], None]


class Connection:
    """One JSON-lines connection, symmetric: either side sends requests and events.

    Incoming requests go to `on_request` (its return value is the reply; an exception
    becomes an `Error` reply) and events to `on_event`, both on the reader thread, so
    handlers must not block for long.
    """

    def __init__(
        self,
        sock: socket.socket,
        on_request: RequestHandler | None = None,
        on_event: EventHandler | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        self._sock = sock
        self._reader = sock.makefile("rb")
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future[Message]] = {}
        self.on_request, self.on_event, self.on_close = on_request, on_event, on_close
        self.closed = threading.Event()

    def start(self, name: str = "control-reader") -> Connection:
        threading.Thread(target=self._read_loop, name=name, daemon=True).start()
        return self

    def request(self, body: Message, timeout_s: float) -> Message:
        """Sends a request and waits for its reply."""
        rid = next(self._ids)
        fut: Future[Message] = Future()
        self._waiting[rid] = fut
        self._send({"type": body.TYPE, "id": rid, "reply_to": None, "body": body.model_dump()})
        try:
            reply = fut.result(timeout=timeout_s)
        finally:
            self._waiting.pop(rid, None)
        if isinstance(reply, Error):
            raise RemoteError(reply.message)
        return reply

    def notify(self, body: Message) -> None:
        """Sends an event (no reply)."""
        self._send({"type": body.TYPE, "id": None, "reply_to": None, "body": body.model_dump()})

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _send(self, envelope: dict[str, Any]) -> None:
        line = (json.dumps(envelope) + "\n").encode()
        with self._send_lock:
            self._sock.sendall(line)

    def _read_loop(self) -> None:
        try:
            for line in self._reader:
                self._dispatch(json.loads(line))
        except (OSError, ValueError):
            pass  # connection gone; on_close tells the owner
        finally:
            self.closed.set()
            for fut in list(self._waiting.values()):
                if not fut.done():
                    fut.set_exception(ConnectionError("control connection closed"))
            if self.on_close is not None:
                self.on_close()

    def _dispatch(self, envelope: dict[str, Any]) -> None:
        body = MESSAGES[envelope["type"]].model_validate(envelope["body"])
        if envelope.get("reply_to") is not None:
            fut = self._waiting.get(envelope["reply_to"])
            if fut is not None and not fut.done():
                fut.set_result(body)
        elif envelope.get("id") is not None:
            try:
                if self.on_request is None:
                    raise RuntimeError(f"no handler for {body.TYPE}")
                reply = self.on_request(body)
            except Exception as exc:  # the requester sees it as RemoteError
                reply = Error(message=f"{type(exc).__name__}: {exc}")
            self._send(
                {
                    "type": reply.TYPE,
                    "id": None,
                    "reply_to": envelope["id"],
                    "body": reply.model_dump(),
                }
            )
        elif self.on_event is not None:
            self.on_event(body)


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def connect(address: str, timeout_s: float = 30.0) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=timeout_s)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
