"""A look at one replica of the rendezvous store: its role and incarnation.

Each replica names its role under ROLE_KEY, "serving <incarnation>", "standby
<incarnation>" or "fresh <incarnation>" (`trainmover.runtime.rendezvous`). Clients and
the replicas themselves look often, so a `Look` keeps one lasting client per replica, and a `Vigil` on it
(`storewatch`): a replica whose process died is seen gone without an operation on the
dead client, whose error path would wait on a reverse name lookup.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from trainmover.runtime.storegate import local_end
from trainmover.runtime.storewatch import ReplicaEnded, Vigil, unless_ended
from trainmover.runtime.tcpstore import connect, spares_of

#: Where each replica names its role ("serving <incarnation>", "standby <incarnation>"...).
ROLE_KEY = "__trainmover/replica"
SERVING, STANDBY = "serving", "standby"
#: A standby that has not seen a replica serve since it started: every client holds
#: spare connections to a standby that has, so that one takes over first
#: (`trainmover.runtime.rendezvous`).
FRESH = "fresh"
#: What `probe` says of a replica that listens but did not answer in time.
UNKNOWN = "unknown"
#: How long a connection to a replica may take (a dead host fails after this; a dead
#: process at once).
CONNECT_S = 0.5
#: How long a replica that accepted the connection may take to answer (a loaded host).
ANSWER_S = 5.0
#: How long a look waits for a connection to a replica that died and came back.
REBORN_S = 0.3


def reachable(host: str, port: int) -> bool:
    """Something listens at host:port (a TCPStore client would retry for its whole
    timeout instead)."""
    try:
        socket.create_connection((host, port), timeout=CONNECT_S).close()
    except OSError:
        return False
    return True


def probe(host: str, port: int, plain: bool = False) -> tuple[str, str] | None:
    """(role, incarnation) of the replica at host:port; None when nothing listens there,
    (UNKNOWN, "") when it listens but does not answer in time (it may well serve). With
    `plain`, a store that names no role (any TCPStore, as the job's only one) serves, as
    one incarnation."""
    if not reachable(host, port):
        return None
    try:
        at, to = local_end(host, port)
        client = dist.TCPStore(at, to, is_master=False, timeout=timedelta(seconds=ANSWER_S))
        if not client.check([ROLE_KEY]):
            return (SERVING, "") if plain else None
        role, _, incarnation = client.get(ROLE_KEY).decode().partition(" ")
    except RuntimeError:
        return UNKNOWN, ""
    return role, incarnation


class Look:
    """Looks at one replica through one lasting client. A TCPStore server stalls for
    seconds after a burst of new connections (here: a few dozen within a second), so a
    process that looks every few milliseconds must not open a connection each time.

    A look's operations leave as soon as the replica's vigil ends (`unless_ended`): one
    in flight when the server died, or sent before this process saw it die, would wait
    on c10d's error path, and a standby's watch waiting there would delay its takeover.
    A replica seen to die and come back is a new process: until it first answers, it
    cannot serve (it starts `fresh`), so a look that cannot reach it within REBORN_S
    says nothing serves there rather than holding the watch for ANSWER_S."""

    def __init__(self, host: str, port: int, plain: bool = False):
        self.host, self.port, self.plain = host, port, plain
        #: The client of the last look that got an answer (None after a failure).
        self.client: dist.TCPStore | None = None
        #: Watches the client's server: once it ended, the client is not asked again.
        self._vigil: Vigil | None = None
        #: The server was seen to die; its successor has not answered yet.
        self._reborn = False

    def look(self) -> tuple[str, str] | None:
        """As `probe`, reusing the client while it answers."""
        try:
            if self._vigil is not None and not self._vigil.alive:
                self._lost()
            if self.client is None:
                if not reachable(self.host, self.port):
                    return None
                self._vigil = Vigil(self.host, self.port)  # first: a death after it is seen
                within_s = REBORN_S if self._reborn else ANSWER_S
                self.client = connect(
                    self.host, self.port, ANSWER_S, connect_s=ANSWER_S, within_s=within_s
                )
            assert self._vigil is not None  # opened with the client
            client, ended = self.client, self._vigil.ended
            if not unless_ended(lambda: client.check([ROLE_KEY]), ended):
                return (SERVING, "") if self.plain else None
            role, _, incarnation = (
                unless_ended(lambda: client.get(ROLE_KEY), ended).decode().partition(" ")
            )
            self._reborn = False
            return role, incarnation
        except ReplicaEnded:
            self._lost()
            return None
        except RuntimeError:
            self.forget()
            if self._reborn:
                return None
            return (UNKNOWN, "") if reachable(self.host, self.port) else None

    def _lost(self) -> None:
        """Its server died: asked, its client or a spare of that server would fail slowly
        (`storewatch`); the spares are opened again for its return."""
        spares_of(self.host, self.port).flush()
        self.forget()
        self._reborn = True

    def forget(self) -> None:
        """Drops the client (its server went, or it failed); the next look connects."""
        self.client = None
        if self._vigil is not None:
            self._vigil.close()
            self._vigil = None
