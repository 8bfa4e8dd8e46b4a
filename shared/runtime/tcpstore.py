"""TCPStore servers and connections that never make the job wait on a name resolver.

c10d names the peer of every TCPStore connection with getnameinfo(3), without
NI_NUMERICHOST: a reverse name lookup, at both ends. On a server it runs on the store's
one event-loop thread, so while it waits no client of that store is answered; on a
client it runs inside the connect. A server that listens dual-stack (c10d's default,
`::`) sees a peer on loopback as the IPv4-mapped ::ffff:127.0.0.1, which the hosts file
does not list, so every accepted connection became a DNS query; a resolver that drops
one query now and then (on these hosts about one in fifty) leaves the lookup waiting out
glibc's 5 s timeout. A move opens a burst of connections (a joiner's vote, progress
board and group builds), so nearly every move met one: the whole job waited 5 s.

Two things keep the lookups off the job's path:

- `serve`: every store this project serves listens on a socket of its host's own address
  family (IPv4 for an IPv4 host, `0.0.0.0` included), handed to c10d; a peer is then seen
  by the address it came from (127.0.0.1 on loopback, which the hosts file names), and
  the server's thread never waits on DNS for a local peer.
- `connect`: a process's clients of a store come from connections opened ahead of need,
  on background threads, several at once (`Spares`); a connect that waits on the
  resolver delays a spare, not an operation.

Remote peers (a rendezvous service on another host) still cost the server a reverse
lookup per connection; with lasting, pre-opened connections those happen when a rank
starts, not during a move (docs/operations.md: keep the lookups of the job's hosts local).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from trainmover.runtime import inflight
from trainmover.runtime.storegate import local_end

#: Connections each process keeps open and idle to each of the job's store servers: a
#: joiner's switch opens about this many at once (its vote's three, the progress board,
#: its group builds, the recovery's own).
SPARES = 8
#: Those to a machine's own vote store (a handful of its ranks' clients).
LOCAL_SPARES = 4
#: Seconds spares lost with their server are tried again for (a restarted replica takes
#: seconds to import torch and come back on its port).
REOPEN_S = 60.0
#: Longest wait of one connect in c10d (which itself tries again within it, so a try
#: that fails takes up to about twice this); a longer wait is made of several tries.
TRY_S = 1.0
#: Seconds between two tries of a spare whose server is not back.
REOPEN_PAUSE_S = 0.5
#: Connects a caller that finds no idle connection starts beside those in flight: the
#: resolver drops queries in bursts, so one more is often stuck too.
EXTRA = 2
#: Backlog of a served store's listening socket (every rank of a job may connect at once).
BACKLOG = 4096


def _family(host: str) -> socket.AddressFamily:
    """The address family a store served on `host` listens in."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name: listen where it resolves first
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]


def _listening(host: str, port: int) -> bool:
    """Something accepts connections at host:port (a plain socket: no name lookup)."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


def serve(host: str, port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server on `host`:`port` (0: a free one), listening on a socket of the
    host's own address family only (module docstring)."""
    family = _family(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host == "::" else 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # c10d owns the descriptor from here on, and closes it with the server.
    return dist.TCPStore(
        host,
        bound,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),
    )


class Spares:
    """Connections to one store server, opened ahead of need on background threads."""

    def __init__(
        self, host: str, port: int, connect_s: float, keep: int = SPARES, gated: bool = True
    ):
        self.host, self.port, self.connect_s, self.keep = host, port, connect_s, keep
        #: A store that may sit behind a gate (`storegate`): the job's, not a machine's.
        self.gated = gated
        self._ready: list[dist.TCPStore] = []
        self._opening = 0
        self._cond = threading.Condition()
        #: The last connect that failed (monotonic time, error), for a waiting `take`.
        self._failed: tuple[float, str] = (float("-inf"), "")
        #: Set once this process forgot the server (`forget`): no more tries.
        self._dropped = False
        #: Counts the server's losses (`flush`): a connect begun before one is stale.
        self._lost = 0

    def _open_one(self, until: float, lost: int) -> None:
        """One connection; tried again, REOPEN_PAUSE_S apart, for `connect_s` or until
        `until` (monotonic), and for REOPEN_S more while its server listens: a connect
        that failed there waited out the resolver, and a spare given up would be missing
        at the next failover, when the process needs every one it has. Each try waits
        in c10d for at most TRY_S, and a try again only while something listens there
        (a plain connect, first): a process that exits never waits long for one
        (`inflight`)."""
        now = time.monotonic()
        listening_until, until = now + REOPEN_S, max(until, now + self.connect_s)
        again = until > now + self.connect_s  # tried until its server is back: it may not be
        while True:
            try:
                client = self._connect(retry=again)
            except inflight.Exiting:
                client = None
            except RuntimeError as err:
                with self._cond:
                    self._failed = (time.monotonic(), str(err))
                    self._cond.notify_all()
                now = time.monotonic()
                again = now + REOPEN_PAUSE_S <= until or (
                    now <= listening_until and _listening(self.host, self.port)
                )
                with self._cond:
                    if self._dropped or not again:
                        self._opening -= 1
                        return
                time.sleep(REOPEN_PAUSE_S)  # a server coming back: nothing to await
                continue
            with self._cond:
                self._opening -= 1
                if client is not None and lost == self._lost:  # else stale, or exiting
                    self._ready.append(client)
                self._cond.notify_all()
            return

    def _connect(self, retry: bool) -> dist.TCPStore:
        """A new client of the server; a `retry` fails at once while nothing listens."""
        if retry and not _listening(self.host, self.port):
            raise dist.DistNetworkError(f"nothing listens at {self.host}:{self.port}")
        host, port = local_end(self.host, self.port) if self.gated else (self.host, self.port)
        with inflight.inside():
            return dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=min(self.connect_s, TRY_S))
            )

    def _start(self, n: int, retry_s: float = 0.0) -> None:
        """Opens `n` more connections in the background (the condition held), each tried
        for `retry_s` more where its server is not there yet."""
        until = time.monotonic() + retry_s
        for _ in range(n):
            self._opening += 1
            threading.Thread(
                target=self._open_one, args=(until, self._lost), name="store-connect", daemon=True
            ).start()

    def fill(self) -> None:
        """Tops the idle connections up to `keep`."""
        with self._cond:
            self._start(max(self.keep - len(self._ready) - self._opening, 0))

    def take(self, timeout_s: float) -> dist.TCPStore:
        """A connected client of its own for the caller; raises RuntimeError when none
        could be had within `timeout_s` (every connect failed, or none ended in time)."""
        began = time.monotonic()
        deadline = began + timeout_s
        with self._cond:
            # A connect of its own beside those in flight: one stuck on the resolver is
            # then not the only one this caller can get.
            if not self._ready:
                self._start(EXTRA)
            while not self._ready:
                failed_at, error = self._failed
                if self._opening == 0 and failed_at >= began:
                    # A connect that timed out on the resolver is tried again; a server
                    # that is gone is the caller's to handle (another replica may serve).
                    # While connects are in flight, one may reach a server coming back.
                    if not _listening(self.host, self.port):
                        raise dist.DistNetworkError(
                            f"no connection to the store at {self.host}:{self.port}: {error}"
                        )
                    self._start(EXTRA)
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if not self._ready:
                        raise dist.DistNetworkError(
                            f"no connection to the store at {self.host}:{self.port} "
                            f"within {timeout_s:.1f} s"
                        )
            client = self._ready.pop()
            self._start(max(self.keep - len(self._ready) - self._opening, 0))
            return client

    def flush(self) -> None:
        """Drops the idle connections (their server went) and opens new ones in the
        background, tried until the server is back (REOPEN_S): a client that moves to it
        later, as after the next loss, finds them ready."""
        with self._cond:
            self._lost += 1
            self._ready.clear()
            self._start(self.keep, retry_s=REOPEN_S)

    def drop(self) -> None:
        """This process is done with the server: idle connections and tries end."""
        with self._cond:
            self._dropped = True
            self._ready.clear()


_SPARES: dict[tuple[str, int], Spares] = {}
_SPARES_LOCK = threading.Lock()


def spares_of(host: str, port: int, connect_s: float = 30.0, gated: bool = True) -> Spares:
    """This process's spare connections to the store at host:port, opening them now
    (`gated`: through its gate, where the job's stores have one)."""
    with _SPARES_LOCK:
        spares = _SPARES.get((host, port))
        if spares is None:
            keep = SPARES if gated else LOCAL_SPARES
            spares = _SPARES[(host, port)] = Spares(host, port, connect_s, keep, gated)
            spares.fill()
        return spares


def forget(host: str, port: int) -> None:
    """The store at host:port is gone for good: its spare connections are dropped."""
    with _SPARES_LOCK:
        spares = _SPARES.pop((host, port), None)
    if spares is not None:
        spares.drop()


def connect(
    host: str,
    port: int,
    timeout_s: float,
    connect_s: float = 30.0,
    gated: bool = True,
    within_s: float | None = None,
) -> dist.TCPStore:
    """A client of the store at host:port, of the caller's own, taken from this process's
    spare connections (waiting for one `within_s`, by default the longer of the two
    timeouts); its operations time out after `timeout_s`."""
    spares = spares_of(host, port, connect_s, gated)
    client = spares.take(max(timeout_s, connect_s) if within_s is None else within_s)
    client.set_timeout(timedelta(seconds=timeout_s))
    return client
