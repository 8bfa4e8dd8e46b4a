"""The job's half of the per-step commit vote, spread over the store's shards.

The job's store serializes every request on one thread, so a flat vote costs it about
three requests per voter and step (the vote, and the watcher's wait and read of the
decision): at a thousand ranks, more than a short step. With shards (the rendezvous
service's `--store-shards N`: N more stores beside the job's, failing over with it),
each voter counts in its shard and only one voter per shard reaches the job's store:

    full  = vote(shard, "{job}/commit/{epoch}/{step}/votes", members)   # in the shard
    the voter that filled it:  claim(root, ".../shard/{s}")             # once per shard
                               vote(root, ".../votes", shards) -> "commit"

The claim (a compare-and-set of a value only this process writes) keeps a shard from
counting twice in the job's store: after a shard's loss its voters re-cast their votes
and another of them may find the shard full again. Every decision is made in the job's
store, as without shards, so a step is applied everywhere or nowhere and an abort
written there stands. Each shard's first voter (with a machine store: that machine's
local rank 0) watches the job's store and relays every decision into its shard, where
the shard's other voters watch; a rank that aborts writes the job's decision into its own
shard too, and a watcher that hears nothing from its shard within a watch slice reads
the job's store. The job's store thus sees, per step, one claim, one vote and one
watcher per shard, and each shard a vote and a watcher per voter; shards are stores of
their own (each its own server thread), so they count in parallel.
"""

from __future__ import annotations

import secrets

from trainmover.runtime.storeclient import Store

SHARDS_KEY = "__trainmover/shards"
"""In the job's store: the shards' addresses, `;`-separated, each `host:port[,host:port]`
(its replicas, in the order of the job's store's replicas)."""

FULL = "full"


def shard_addresses(root: Store) -> list[str]:
    """The shards the job's store names (none: a store without shards)."""
    value = root.peek(SHARDS_KEY)
    return [a for a in value.decode().split(";") if a] if value else []


def shard_of(voter: int, voters: int, shards: int) -> int:
    """The shard of voter `voter` of `voters` (contiguous runs of voters: a pod's
    machines share one)."""
    return voter * shards // voters


def members(shard: int, voters: int, shards: int) -> list[int]:
    """The voters of `shard`, in order."""
    return [v for v in range(voters) if shard_of(v, voters, shards) == shard]


class ShardVote:
    """One voter's shard: its vote there, the climb of a full shard into the job's
    store, and (for the shard's first voter) the relay of the job's decisions."""

    def __init__(
        self,
        addresses: list[str],
        voter: int,
        voters: int,
        timeout_s: float,
        relays: bool,
    ):
        """`relays`: this process relays decisions into the shard, where it is the
        shard's first voter (the caller knows whether this process speaks for it)."""
        self.shards = len(addresses)
        if not 0 < self.shards <= voters:
            raise ValueError(f"{self.shards} store shards for {voters} voters")
        self.index = shard_of(voter, voters, self.shards)
        voters_here = members(self.index, voters, self.shards)
        self.threshold = len(voters_here)
        self.relays = relays and voter == voters_here[0]
        address = addresses[self.index]
        #: A client per thread: the voting thread, the watcher, and aborts (any thread).
        self.voting = Store(address, timeout_s)
        self.watching = Store(address, timeout_s)
        self.aborting = Store(address, timeout_s)
        self.share = self.voting.share
        # Connected now, not on the first step's path: a TCPStore client's connection
        # can take seconds where the host's resolver is slow (c10d looks up the name of
        # the peer's address).
        for store in (self.voting, self.watching):
            store.check([SHARDS_KEY])
        #: What this process writes into its claims: nobody else writes it.
        self._token = secrets.token_hex(8)

    def cast(self, root: Store, prefix: str, previous: str, commit: str) -> bool:
        """Votes in the shard for the step whose keys start with `prefix`; the voter that
        fills the shard drops the step before's keys (`previous`: every voter of the
        shard has read its decision) and casts the shard's vote in the job's store, once.
        True for the vote that filled the job's store, and wrote `commit` there (its
        caller drops the step before's keys there)."""
        votes, full = f"{prefix}/votes", f"{prefix}/full"
        if self.voting.vote(votes, self.threshold, full, FULL) != self.threshold:
            return False
        for what in ("votes", "full", "decision"):
            self.voting.delete_key(f"{previous}/{what}")
        claim = f"{prefix}/shard/{self.index}"
        if root.compare_set(claim, "", self._token).decode() != self._token:
            return False  # another voter climbed for this shard (a re-cast refilled it)
        root.delete_key(f"{previous}/shard/{self.index}")
        return root.vote(f"{prefix}/votes", self.shards, f"{prefix}/decision", commit) == (
            self.shards
        )

    def relay(self, key: str, decision: str, store: Store | None = None) -> None:
        """Writes the job's decision under `key` into the shard (never over another)."""
        (store or self.watching).compare_set(key, "", decision)

    def forget(self, prefix: str) -> None:
        self.share.forget(prefix)
