"""The rendezvous store as a rank uses it: whichever replica serves, and this process's
share of the store's state re-cast into a new incarnation when the serving one is lost.

The job's store is one or more replicas (`host:port,host:port`,
`trainmover.runtime.rendezvous`), exactly one of them serving; each names its role and
incarnation under ROLE_KEY. A client uses the serving replica; when an operation finds
it gone (a `DistNetworkError`), the client looks for the serving one again (a standby
promoted, or the same replica restarted) for up to its timeout, then retries there.

Nothing in a store replica is durable, and none of it needs to be: every key the
runtime's agreements use is either written once (a decision, a claim, a barrier flag)
or a counter of votes. Each process keeps its share:

- facts: every write-once value it wrote, or read, or lost a compare-and-set to;
- votes: what it added to each counter, and the decision that the counter's threshold
  makes (`vote`: whoever brings the counter to its threshold writes the decision).

On a new incarnation the process re-casts its share there before any other operation of
its own: facts first, with compare-and-set from empty (a value seen anywhere stays the
value), then its votes, each re-deciding its threshold. A counter reaches its threshold
in the new incarnation only once every voter has re-cast, and every voter re-cast its
facts before its votes, so a threshold's decision can never displace one that any
process had seen (an "abort" read before the loss stays "abort"). The store's loss thus
costs a pause, never a decision, and existing communication groups never notice it
(gloo and NCCL use the store only while a group is built; a build in flight fails, and
the migration that needed it is re-planned).

A caller keeps its share bounded with `forget(prefix)` once nobody can ask for those
keys again. Clients that write what changes (the progress board) use `recast=False`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist

from trainmover.ports import store_addresses
from trainmover.runtime.steptime import WAITS
from trainmover.runtime.storelook import CONNECT_S, ROLE_KEY, SERVING, Look
from trainmover.runtime.storewatch import Vigil, unless_ended
from trainmover.runtime.tcpstore import connect, spares_of

#: A value no key of the runtime holds: a compare-and-set expecting it only reads (the
#: store answers the current value, or this one for a key it lacks).
ABSENT = "__trainmover/absent"
#: Pause between two rounds over the replicas while none serves.
_ROUND_S = 0.1

T = TypeVar("T")


class StoreLost(RuntimeError):
    """No replica of the rendezvous store served within the time given."""


@dataclass
class _Vote:
    counter: str
    n: int
    threshold: int
    decision: str
    value: str


class Share:
    """One process's view of one store (all its clients of `address`): the serving
    replica, its incarnation, and what this process re-casts into the next one."""

    def __init__(self, address: str):
        self.address = address
        self._replicas = store_addresses(address)
        self._lock = threading.Lock()
        #: Bumped at every move to another replica; a client of an older one reconnects.
        self.generation = 0
        #: The serving replica's incarnation (None: not looked for yet).
        self.incarnation: str | None = None
        self._serving: tuple[str, int] | None = None
        #: Watches the serving replica: its end releases operations in flight there.
        self._vigil: Vigil | None = None
        self._facts: dict[str, str] = {}
        self._votes: dict[str, _Vote] = {}
        #: Per incarnation, what this process's votes added to each counter there (an
        #: add whose answer was lost counts: a vote is never cast twice into one).
        self._cast: dict[str, dict[str, int]] = {}
        #: The job's store is one replica: there is nowhere to fail over to.
        self.single = len(self._replicas) == 1
        plain = self.single
        self._looks = {r: Look(*r, plain=plain) for r in self._replicas}
        # Connections to every replica opened now, off any step's path (`tcpstore`).
        for replica in self._replicas:
            spares_of(*replica, connect_s=CONNECT_S * 4)
        #: Called (generation, incarnation) after each move, outside the lock.
        self.on_move: list[Callable[[int, str], None]] = []

    @contextmanager
    def _held(self) -> Iterator[None]:
        """The share's lock. A thread may hold it through a whole failover (a look at
        each replica, the re-cast): another thread blocked on it waits on the store, and
        its time counts as waiting, not computing (the progress board)."""
        if not self._lock.acquire(blocking=False):
            with WAITS.waiting():
                self._lock.acquire()
        try:
            yield
        finally:
            self._lock.release()

    def serving(self, deadline: float) -> tuple[tuple[str, int], int, str]:
        """The serving replica, its generation and incarnation, looked for until
        `deadline`."""
        with self._held():
            if self._serving is None:
                self._find(deadline)
            assert self._serving is not None and self.incarnation is not None
            return self._serving, self.generation, self.incarnation

    def lost(self, generation: int, deadline: float) -> None:
        """A client of `generation` lost its replica: move on (once for every client of
        that generation), re-casting this process's share."""
        moved: tuple[int, str] | None = None
        with self._held():
            if generation == self.generation:
                before, gone = self.incarnation, self._serving
                self._serving = None
                if gone is not None:
                    spares_of(*gone).flush()  # their server went with it
                    # Asked again, its client would fail through c10d's error path,
                    # which waits on a reverse name lookup (`storewatch`) with this
                    # lock held: a look starts from a plain connect instead.
                    self._looks[gone].forget()
                self._find(deadline, gone)
                if self.incarnation != before:
                    moved = (self.generation, self.incarnation or "")
        if moved is not None:
            for callback in list(self.on_move):
                callback(*moved)

    def _find(self, deadline: float, gone: tuple[str, int] | None = None) -> None:
        # The one just lost last: it is the least likely to serve now.
        order = sorted(self._replicas, key=lambda r: r == gone)
        while True:
            for replica in order:
                look = self._looks[replica]
                seen = look.look()
                if seen is None or seen[0] != SERVING:
                    continue
                if seen[1] != self.incarnation:
                    if self.incarnation is not None:
                        try:
                            self._recast_all(look, seen[1])
                        except RuntimeError:
                            look.client = None
                            continue  # that one went too
                    self.incarnation = seen[1]
                    self.generation += 1
                if replica != self._serving or self._vigil is None or not self._vigil.alive:
                    if self._vigil is not None:
                        self._vigil.close()
                    self._vigil = Vigil(*replica)
                self._serving = replica
                return
            if time.monotonic() >= deadline:
                raise StoreLost(
                    f"no replica of the rendezvous store {self.address} serves"
                    + (" (the one in use was lost)" if gone else "")
                )
            time.sleep(_ROUND_S)

    def ended(self, generation: int) -> concurrent.futures.Future[None]:
        """Resolves when the replica that `generation` uses is gone (at once for a
        generation this process has moved on from)."""
        vigil = self._vigil
        if generation != self.generation or vigil is None:
            gone: concurrent.futures.Future[None] = concurrent.futures.Future()
            gone.set_result(None)
            return gone
        return vigil.ended

    def _client(self) -> dist.TCPStore:
        """The serving replica's client of its look: a re-cast opens no connection."""
        assert self._serving is not None
        client = self._looks[self._serving].client
        if client is None:
            raise StoreLost(f"the serving replica {self._serving} of {self.address} went")
        return client

    def _recast_all(self, look: Look, incarnation: str) -> None:
        """This process's share into `incarnation` (reached through `look`)."""
        client = look.client
        assert client is not None
        for key, value in self._facts.items():
            client.compare_set(key, "", value)
        cast = self._cast.setdefault(incarnation, {})
        for old in list(self._cast)[:-4]:  # incarnations this process will not meet again
            del self._cast[old]
        for vote in self._votes.values():
            owed = vote.n - cast.get(vote.counter, 0)
            if owed > 0:
                cast[vote.counter] = vote.n
                self._decide(client, vote, client.add(vote.counter, owed))

    def claim(self, incarnation: str, counter: str) -> bool:
        """True when this process's vote on `counter` is still to be cast into
        `incarnation` (it is then taken as cast)."""
        with self._held():
            vote = self._votes.get(counter)
            cast = self._cast.setdefault(incarnation, {})
            if vote is None or cast.get(counter, 0) >= vote.n:
                return False
            cast[counter] = cast.get(counter, 0) + 1
            return True

    def _decide(self, client: dist.TCPStore, vote: _Vote, count: int) -> None:
        if vote.threshold and count >= vote.threshold:
            self._facts[vote.decision] = client.compare_set(vote.decision, "", vote.value).decode()

    @staticmethod
    def is_current(client: dist.TCPStore, expected: str) -> bool:
        """`client` reaches incarnation `expected`."""
        if not expected:  # a plain store: it names no role
            return True
        if not client.check([ROLE_KEY]):
            return False
        return client.get(ROLE_KEY).decode() == f"{SERVING} {expected}"

    # -- the share -----------------------------------------------------------------------

    def fact(self, key: str, value: str, generation: int, deadline: float) -> None:
        """`key` holds `value` (seen on `generation`); re-cast now if the store moved
        since."""
        with self._held():
            self._facts[key] = value
            if generation != self.generation and self._serving is not None:
                try:
                    self._client().compare_set(key, "", value)
                except RuntimeError:
                    pass  # lost again: the next move re-casts it with the rest

    def vote(self, vote: _Vote) -> None:
        """Records a vote before it is cast (a move after this re-casts it)."""
        with self._held():
            known = self._votes.get(vote.counter)
            if known is not None:
                vote.n += known.n
            self._votes[vote.counter] = vote

    def drop(self, key: str) -> None:
        with self._held():
            self._facts.pop(key, None)
            self._votes.pop(key, None)

    def forget(self, prefix: str) -> None:
        """Nobody will ask for keys under `prefix` again."""
        with self._held():
            tables: list[dict[str, Any]] = [self._facts, self._votes, *self._cast.values()]
            for table in tables:
                for key in [k for k in table if k.startswith(prefix)]:
                    del table[key]

    def size(self) -> int:
        with self._held():
            return len(self._facts) + len(self._votes)


_SHARES: dict[str, Share] = {}
_SHARES_LOCK = threading.Lock()


def share_of(address: str) -> Share:
    """This process's share of the store at `address` (one per address)."""
    with _SHARES_LOCK:
        share = _SHARES.get(address)
        if share is None:
            share = _SHARES[address] = Share(address)
        return share


class Store:
    """A client of the job's rendezvous store for one thread, failing over between its
    replicas (module docstring). The operations are TCPStore's; `vote` adds a counted
    decision, and `raw()` gives a plain TCPStore of the serving replica (for a group's
    backend, which must not outlive an incarnation anyway)."""

    def __init__(
        self, address: str, timeout_s: float, recast: bool = True, share: Share | None = None
    ):
        if not address:
            raise RuntimeError("no rendezvous store known (a standby learns it when it joins)")
        #: This process's share (`share`: another one, as a second process would have).
        self.share = share or share_of(address)
        self.timeout_s = timeout_s
        self._recast = recast
        self._tcp: dist.TCPStore | None = None
        self._generation = -1
        self._incarnation = ""

    # -- plumbing ------------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _open(self, deadline: float) -> tuple[dist.TCPStore, int]:
        """A new client of the serving replica, and its generation: checked to be the
        incarnation this process uses (a replica restarted on the same port is a
        standby, or another incarnation, until this process moves)."""
        while True:
            (host, port), generation, incarnation = self.share.serving(deadline)
            try:
                # With replicas, a short connect (a client retries a refused one for its
                # whole timeout; another replica may serve). The only store is waited
                # for: a server that stalls a few seconds is not a lost one.
                connect_s = self.timeout_s if self.share.single else CONNECT_S * 4
                client = connect(host, port, self.timeout_s, connect_s=connect_s)
                if self.share.is_current(client, incarnation):
                    self._incarnation = incarnation
                    return client, generation
            except RuntimeError:
                pass
            self.share.lost(generation, deadline)

    def _connected(self, deadline: float) -> tuple[dist.TCPStore, int]:
        if self._tcp is None or self.share.generation != self._generation:
            with WAITS.waiting():  # on the store: not computing (the progress board)
                self._tcp, self._generation = self._open(deadline)
        return self._tcp, self._generation

    def _run(
        self,
        op: Callable[[dist.TCPStore], T],
        first: Callable[[dist.TCPStore, int], T] | None = None,
        blocking: bool = False,
    ) -> tuple[T, int]:
        """`op` on the serving replica, retried on the next one when it is lost;
        `first(client, generation)` instead of `op` on the first attempt. The whole of it
        is waiting on the store, never computing (the progress board): a replica just
        promoted answers a burst of reconnecting ranks seconds late. The caller leaves
        an operation the moment its replica dies (`storewatch.unless_ended`; `blocking`:
        one that waits on the store's keys)."""
        deadline = self._deadline()
        attempt = 0
        with WAITS.waiting():
            while True:
                client, generation = self._connected(deadline)
                ended = self.share.ended(generation)
                try:
                    if attempt == 0 and first is not None:
                        call = partial(first, client, generation)
                    else:
                        call = partial(op, client)
                    return unless_ended(call, ended, blocking), generation
                except dist.DistNetworkError:
                    self._tcp = None
                    self.share.lost(generation, deadline)
                attempt += 1

    def _fact(self, key: str, value: bytes, generation: int) -> bytes:
        if self._recast:
            self.share.fact(key, value.decode(), generation, self._deadline())
        return value

    # -- TCPStore's operations -------------------------------------------------------------

    def set(self, key: str, value: str) -> None:
        if self._recast:
            self.share.fact(key, value, self.share.generation, self._deadline())
        self._run(lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        value, generation = self._run(lambda s: s.get(key), blocking=True)
        return self._fact(key, value, generation)

    def peek(self, key: str) -> bytes | None:
        """The key's value, or None where it has none, in one request (`get` waits for
        the key first: two). For a key just waited for: the decision a watcher saw."""
        value, generation = self._run(lambda s: s.compare_set(key, ABSENT, ABSENT))
        if value == ABSENT.encode():
            return None
        return self._fact(key, value, generation)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value, generation = self._run(lambda s: s.compare_set(key, expected, desired))
        return self._fact(key, value, generation)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values, generation = self._run(lambda s: s.multi_get(keys), blocking=True)
        return [self._fact(k, v, generation) for k, v in zip(keys, values, strict=True)]

    def check(self, keys: list[str]) -> bool:
        return self._run(lambda s: s.check(keys))[0]

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        end = time.monotonic() + timeout.total_seconds()

        def wait(s: dist.TCPStore) -> None:
            s.wait(keys, timedelta(seconds=max(end - time.monotonic(), 0.001)))

        self._run(wait, blocking=True)

    def count(self, counter: str) -> int:
        """The counter's value (an add of 0)."""
        return self._run(lambda s: s.add(counter, 0))[0]

    def delete_key(self, key: str) -> bool:
        self.share.drop(key)
        return self._run(lambda s: s.delete_key(key))[0]

    def num_keys(self) -> int:
        return self._run(lambda s: s.num_keys())[0]

    # -- counted decisions -----------------------------------------------------------------

    def vote(self, counter: str, threshold: int, decision: str, value: str) -> int:
        """Adds one to `counter`; whoever brings it to `threshold` writes `value` into
        `decision` unless it holds one. Returns the counter as this vote left it (or, after
        a move, as it is now: the move re-cast this vote)."""
        self.share.vote(_Vote(counter, 1, threshold, decision, value))

        def first(s: dist.TCPStore, generation: int) -> int:
            # A move since the vote was recorded may have re-cast it already.
            return s.add(counter, 1 if self.share.claim(self._incarnation, counter) else 0)

        # A retry does not know whether the lost attempt counted: it only reads (a vote
        # missing is a stall the timeout ends; a vote counted twice would be a commit).
        count, _ = self._run(lambda s: s.add(counter, 0), first)
        if threshold and count >= threshold:
            self.compare_set(decision, "", value)
        return count

    def forget(self, prefix: str) -> None:
        self.share.forget(prefix)

    def raw(self) -> dist.TCPStore:
        """A plain TCPStore client of the serving replica, of this thread's own."""
        with WAITS.waiting():  # on the store: not computing (the progress board)
            return self._open(self._deadline())[0]
