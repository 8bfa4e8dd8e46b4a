"""The rendezvous store's host: one replica of a job's store, in a process that does not
train (the rendezvous service, or `trainmover up` itself), never on a training machine
that could be migrated away.

A job runs one replica, or several (the rendezvous service's `--replicas`), of which
exactly one serves; each names its role under ROLE_KEY (`trainmover.runtime.storelook`),
and clients use the serving one. A standby watches the others: when none serves, the
first live replica in the list's order promotes itself, after TAKEOVER_S. A replica is
`fresh` from its start until it sees one serve, and fresh ones come after every standby
that has: one restarted while the job ran leaves the takeover to a standby that stayed,
to which the clients hold their spare connections already (a promoted newcomer would
have every rank open new ones at once), while replicas started together still take
over in the job's order.
A serving replica that sees an earlier one serving too (two sides of a healed partition)
steps down (`demoted`): its process exits and comes back a standby, and its clients move
to the earlier one. Replicas hold no state of their own worth keeping: clients re-cast
their share of it into whichever serves next.

With `shards` N, each replica hosts N more stores beside the job's (the per-step commit
vote counts in them: `trainmover.runtime.shardvote`), on the N ports after its own, each
a server thread of its own; they take each role with the job's store, and the job's
store names them under SHARDS_KEY.

With a `secret` every one of them listens on loopback behind a gate that admits only
clients holding the job's store secret (`trainmover.runtime.storegate`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from trainmover.ports import store_addresses
from trainmover.runtime import inflight
from trainmover.runtime.shardvote import SHARDS_KEY
from trainmover.runtime.storegate import Gate
from trainmover.runtime.storelook import FRESH, ROLE_KEY, SERVING, STANDBY, UNKNOWN, Look
from trainmover.runtime.tcpstore import serve

#: Seconds between two looks at the other replicas.
POLL_S = 0.1
#: How long a standby sees no replica serving before it takes over: several looks, so
#: that one slow answer on a loaded host is not taken for a loss (two replicas would
#: serve until the later one steps down).
TAKEOVER_S = 1.0


class RendezvousHost:
    """One replica of the store, hosted by this (non-training) process: on an ephemeral
    port by default, or on `port`. `address` is what workers dial; `host` "0.0.0.0"
    listens everywhere and `advertise` names this machine then. `peers` are the other
    replicas' addresses in the job's order, `index` this one's place among them all;
    `shards` the stores of the commit vote it hosts beside the job's (module docstring)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 120.0,
        port: int = 0,
        advertise: str | None = None,
        peers: Sequence[str] = (),
        index: int = 0,
        shards: int = 0,
        secret: bytes | None = None,
    ):
        if shards < 0:
            raise ValueError(f"{shards} store shards: not a number of shards")
        if shards and peers and not port:
            raise ValueError("replicas with shards need a fixed port (theirs follow it)")

        #: The gates in front of the servers, with a `secret` (`storegate`).
        self._gates: list[Gate] = []

        def server(at: int) -> tuple[dist.TCPStore, int]:
            """A server, and the port its clients dial (its gate's, with a secret)."""
            if secret is None:
                store = serve(host, at, timeout_s)
                return store, store.port
            store = serve("127.0.0.1", 0, timeout_s)  # reached only through its gate
            gate = Gate(host, at, store.port, secret)
            self._gates.append(gate)
            return store, gate.port

        self._store, self.port = server(port)
        self.address = f"{advertise or host}:{self.port}"
        served = [server(port + 1 + s if port else 0) for s in range(shards)]
        self._shards = [store for store, _ in served]
        self._shard_ports = [at for _, at in served]
        #: Each shard's address: its replicas, in the job's order.
        self.shards = [
            ",".join(self._replica_of(s, peers, index, advertise or host)) for s in range(shards)
        ]
        if self.shards:
            self._store.set(SHARDS_KEY, ";".join(self.shards))
        self.incarnation = secrets.token_hex(6)
        self._lock = threading.Lock()  # the master client is shared with /healthz
        self._peers = [Look(*store_addresses(p)[0]) for p in peers]
        self._index = index
        #: Set when this replica stepped down for an earlier one (its process then exits).
        self.demoted = threading.Event()
        #: Set each time this replica starts serving.
        self.promoted = threading.Event()
        self._closed = threading.Event()
        #: Rounds of the standby's watch so far (each looks at every peer once).
        self.rounds = 0
        self._round = threading.Condition()
        self.role = ""
        if self._peers:
            self._set_role(FRESH)
            threading.Thread(target=self._watch, name="rendezvous-peers", daemon=True).start()
        else:
            self._set_role(SERVING)

    def _replica_of(self, shard: int, peers: Sequence[str], index: int, host: str) -> list[str]:
        """Shard `shard`'s replicas: on the port after each replica's by the shard's."""
        if not peers:
            return [f"{host}:{self._shard_ports[shard]}"]
        listed = [store_addresses(p)[0] for p in peers]
        listed.insert(index, (host, self.port))
        return [f"{h}:{p + 1 + shard}" for h, p in listed]

    def _set_role(self, role: str) -> None:
        with self._lock:
            if self._closed.is_set():  # the watch's last round outlived `close`
                return
            # The shards first: a client that finds the job's store serving finds them so.
            for shard in self._shards:
                shard.set(ROLE_KEY, f"{role} {self.incarnation}")
            self._store.set(ROLE_KEY, f"{role} {self.incarnation}")
        self.role = role
        if role == SERVING:
            self.promoted.set()

    def _watch(self) -> None:
        served_at = time.monotonic()
        while not self._closed.wait(POLL_S):
            try:
                with inflight.inside():
                    served_at = self._round_of_watch(served_at)
            except inflight.Exiting:
                return
            if self.demoted.is_set():
                return

    def _round_of_watch(self, served_at: float) -> float:
        """One look at every peer and the role it calls for; returns the last time
        (monotonic) one may have served."""
        seen = [peer.look() for peer in self._peers]
        with self._round:
            self.rounds += 1
            self._round.notify_all()
        serving = [i for i, s in enumerate(seen) if s is not None and s[0] == SERVING]
        now = time.monotonic()
        if self.role == SERVING:
            if any(i < self._index for i in serving):
                self.demoted.set()
            return now
        if serving and self.role == FRESH:
            self._set_role(STANDBY)  # it stood by one serving: the clients reach it now
        if serving or any(s is not None and s[0] == UNKNOWN for s in seen):
            served_at = now  # one that listens and does not answer may serve
        # The first live replica takes over; one that ranks before this one will.
        if now - served_at >= TAKEOVER_S and not any(
            self._ranks_before(i, s) for i, s in enumerate(seen)
        ):
            self._set_role(SERVING)
        return served_at

    def _ranks_before(self, peer: int, seen: tuple[str, str] | None) -> bool:
        """The live peer at `peer` in the list takes over before this replica: standbys
        that have seen one serve before fresh ones, each in the job's order."""
        if seen is None:
            return False
        index = peer if peer < self._index else peer + 1
        return (seen[0] == FRESH, index) < (self.role == FRESH, self._index)

    def wait_rounds(self, n: int, timeout_s: float) -> bool:
        """Until the watch has looked at its peers `n` more times; False on timeout."""
        with self._round:
            target = self.rounds + n
            return self._round.wait_for(lambda: self.rounds >= target, timeout_s)

    def keys(self) -> int:
        """Keys in the store: a round trip through its server (a liveness check)."""
        with self._lock:
            return self._store.num_keys()

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            del self._store
            self._shards.clear()
        for gate in self._gates:
            gate.close()
