"""The per-step commit agreement: no rank applies an optimizer step another has not.

Before `optimizer.step()` (an optimizer step pre-hook), every rank of the job votes for
the step through the rendezvous store, which is hosted off the training machines and
arbitrates with one compare-and-set per step:

    votes  = add("{job}/commit/{epoch}/{step}/votes", 1)
    if votes == world: compare_set(decision, "", "commit")       # the last voter decides
    ... a failing rank, or the supervisor:  compare_set(decision, "", "abort")

Whichever write comes first is the decision and every rank reads the same one, so a
step is applied everywhere or nowhere. A rank blocked in a collective never votes, so a
step cannot commit while any rank is stuck in it; a rank that sees a collective fail
writes "abort", and each rank's watcher thread (blocked on the decision key) turns that
into its abort signal within a store round trip, which frees ranks blocked on live peers
(gloo gives only a dead peer's direct neighbours a connection error).

Keys are namespaced by *epoch*: the id of the recovery that started it ("e0" at launch),
so a step re-executed after a recovery votes afresh and a late abort of an old epoch
cannot touch the new one. An aborted epoch never commits again: aborting writes "abort"
into the decision of the first undecided step (if the step was already committed, into
the next one, which this rank will then never vote for).

With a machine store (`trainmover.runtime.machinevote`), the voters in the job's store
are machines, not ranks: the last of a machine's ranks to arrive casts its machine's
vote (threshold: the machines), and local rank 0's watcher relays each decision into the
machine's store, where its other ranks watch it. Where the job's store has shards
(`trainmover.runtime.shardvote`), the voters count in their shard and each full shard
votes in the job's store, which still makes every decision.

The vote is a counted decision of `trainmover.runtime.storeclient`: when the store's
serving replica is lost, each rank re-casts the decisions it saw and its votes into the
next one, so a step decided before the loss keeps its decision, and one undecided is
decided there as it would have been. The loss costs the step a pause of about the
standby's takeover, and no rank's groups.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

from trainmover.runtime.abort import AbortSignal, StepAborted
from trainmover.runtime.machinevote import MachineTally
from trainmover.runtime.shardvote import ShardVote, shard_addresses
from trainmover.runtime.storeclient import Store
from trainmover.runtime.storelook import ROLE_KEY

COMMIT = "commit"
ABORT = "abort"
#: Slice of a blocking wait on the store, so the watcher notices a new target or close.
_WATCH_SLICE = timedelta(seconds=1)
#: How often a voter waiting for a decision looks at how long it has waited.
STALL_POLL_S = 0.25


class CommitAgreement:
    """One rank's side of the vote. `vote()` runs on the training thread, `abort()` on any
    thread, and a watcher thread reads decisions."""

    def __init__(
        self,
        store_address: str,
        job: str,
        world: int,
        signal: AbortSignal,
        committed: int,
        timeout_s: float,
        machine: MachineTally | None = None,
        rank: int = 0,
    ):
        """`machine`: this rank's machine tally, where its machine votes as one; `rank`:
        this rank's place in the job (a machine's ranks are consecutive)."""
        self.job, self.world, self.signal = job, world, signal
        self._machine = machine
        #: Voters of the step: the machines, or every rank.
        self.voters = world // machine.local_world if machine is not None else world
        voter = rank // machine.local_world if machine is not None else rank
        self.timeout_s = timeout_s
        self.epoch = signal.epoch
        #: Last step this rank applied (the decision was "commit").
        self.committed = committed
        #: Seconds the last vote took (the agreement's per-step cost, skew included).
        self.last_vote_s = 0.0
        #: Called on the voting thread, every STALL_POLL_S while a decision is awaited,
        #: with (epoch, step, seconds waited).
        self.on_stall: Callable[[str, int, float], None] | None = None
        self._vote = Store(store_address, timeout_s)
        #: This process's share of the store (`trainmover.runtime.storeclient`).
        self.share = self._vote.share
        self._abort = Store(store_address, timeout_s)
        self._abort_lock = threading.Lock()
        self._cond = threading.Condition()
        self._target: tuple[str, int] | None = None
        self._verdicts: dict[tuple[str, int], str] = {}
        self._closed = False
        self._watch_store = Store(store_address, timeout_s)
        shards = shard_addresses(self._vote)
        self._watch_store.check([ROLE_KEY])  # connected now, not on the first step's path
        #: This rank's shard of the job's store, where it has shards.
        self.shard = (
            ShardVote(
                shards,
                voter,
                self.voters,
                timeout_s,
                relays=machine is None or machine.relays,
            )
            if shards
            else None
        )
        threading.Thread(target=self._watch, name="commit-watcher", daemon=True).start()

    def key(self, epoch: str, step: int, what: str) -> str:
        return f"{self.job}/commit/{epoch}/{step}/{what}"

    # -- training thread ---------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Step `step` starts: watch its decision (an abort frees blocked collectives)."""
        with self._cond:
            self._target = (self.epoch, step)
            self._cond.notify_all()

    def vote(self, step: int) -> None:
        """Votes for `step` and returns once it is committed; raises StepAborted when the
        decision is abort (nothing of the step may then be applied)."""
        started = time.perf_counter()
        epoch = self.epoch
        if self._cast(epoch, step):
            # Every rank has read step - 1's decision before voting for this one.
            for what in ("votes", "decision"):
                self._vote.delete_key(self.key(epoch, step - 1, what))
        self._vote.forget(self.key(epoch, step - 2, ""))
        if self.shard is not None:
            self.shard.forget(self.key(epoch, step - 2, ""))
        verdict = self._await_verdict(epoch, step, started)
        if verdict is None:  # a rank never voted and nobody noticed: give up on the step
            self.abort(f"commit vote of step {step} not decided in {self.timeout_s:.0f}s")
            verdict = self._verdict(epoch, step, self.timeout_s) or ABORT
        self.last_vote_s = time.perf_counter() - started
        if verdict != COMMIT:
            raise StepAborted(f"step {step} aborted by the commit agreement")
        self.committed = step

    def _cast(self, epoch: str, step: int) -> bool:
        """This rank's vote for `step`, or its machine's; True for the vote the job's
        store needed last."""
        decision = self.key(epoch, step, "decision")
        if self._machine is not None:
            try:
                if not self._machine.arrive(self.key(epoch, step, "machine")):
                    return False
                # Every rank of the machine has read step - 1's decision.
                self._machine.forget(self.key(epoch, step - 1, "machine"))
            except RuntimeError as err:  # the machine's store went with its local rank 0
                self.abort(f"the machine's vote store is gone: {err}")
                return False
        if self.shard is not None:
            return self.shard.cast(
                self._vote,
                self.key(epoch, step, "")[:-1],
                self.key(epoch, step - 1, "")[:-1],
                COMMIT,
            )
        votes = self.key(epoch, step, "votes")
        return self._vote.vote(votes, self.voters, decision, COMMIT) == self.voters

    def _await_verdict(self, epoch: str, step: int, started: float) -> str | None:
        """The decision of `step`, waited for up to `timeout_s`; while it does not come,
        `on_stall` hears how long this rank has waited (the progress board then names
        whoever holds the step back, long before the timeout)."""
        while True:
            waited = time.perf_counter() - started
            left = self.timeout_s - waited
            if left <= 0:
                return None
            verdict = self._verdict(epoch, step, min(left, STALL_POLL_S))
            if verdict is not None:
                return verdict
            if self.on_stall is not None:
                self.on_stall(epoch, step, time.perf_counter() - started)

    def _verdict(self, epoch: str, step: int, timeout_s: float) -> str | None:
        with self._cond:
            self._cond.wait_for(lambda: (epoch, step) in self._verdicts, timeout_s)
            self._verdicts.pop((epoch, step - 2), None)  # bounded: only recent steps
            return self._verdicts.get((epoch, step))

    def reset(self, epoch: str, committed: int) -> None:
        """A recovery starts `epoch` with every rank at step `committed`."""
        self._vote.forget(f"{self.job}/commit/{self.epoch}/")
        if self.shard is not None:
            self.shard.forget(f"{self.job}/commit/{self.epoch}/")
        with self._cond:
            self.epoch, self.committed = epoch, committed
            self._target = None
            self._verdicts.clear()
            self._cond.notify_all()

    # -- any thread --------------------------------------------------------------------

    def abort(self, reason: str, epoch: str | None = None) -> bool:
        """Aborts the epoch for every rank: the first undecided step's decision becomes
        "abort". False when `epoch` is not the current one (a late signal)."""
        epoch = epoch or self.epoch
        if epoch != self.epoch:
            return False
        step = self.committed + 1
        # Before the decision: this rank's own reason, not its watcher's echo of it.
        self.signal.set(epoch, reason)
        with self._abort_lock:
            decision = self.key(epoch, step, "decision")
            won = self._abort.compare_set(decision, "", ABORT).decode()
            if self.shard is not None:  # its relay may be gone with the failure
                self.shard.relay(decision, won, self.shard.aborting)
            if won == COMMIT:  # already committed: the next step can never be
                decision = self.key(epoch, step + 1, "decision")
                self._abort.compare_set(decision, "", ABORT)
                if self.shard is not None:
                    self.shard.relay(decision, ABORT, self.shard.aborting)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- watcher thread ----------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._closed
                        or (self._target is not None and self._target not in self._verdicts)
                    )
                )
                if self._closed:
                    return
                target = self._target
            assert target is not None
            started = time.monotonic()
            try:
                value = self._decision(*target)
            except RuntimeError:  # not decided within the slice, or the store went away
                if time.monotonic() - started < _WATCH_SLICE.total_seconds() / 2:
                    time.sleep(0.1)  # an error, not a slice: do not spin
                continue
            if self._machine is not None and self._machine.relays:
                # Before this rank's own vote may return: a rank that stops after its
                # last step must not take the machine's decision with it.
                try:
                    self._machine.relay(self.key(*target, "machine"), value)
                except RuntimeError:  # its own store: gone only with this process
                    pass
            with self._cond:
                self._verdicts[target] = value
                self._cond.notify_all()
            if value == ABORT:
                self.signal.set(target[0], f"step {target[1]} aborted")

    def _decision(self, epoch: str, step: int) -> str:
        """The step's decision, from where this rank watches it (the job's store, its
        shard, or its machine's store), with the job's store behind each relay;
        RuntimeError when none came within a slice."""
        key = self.key(epoch, step, "decision")
        if self._machine is not None and not self._machine.relays:
            try:
                return self._machine.wait(self.key(epoch, step, "machine"), _WATCH_SLICE)
            except RuntimeError:
                # Not relayed within the slice, or the machine's store is gone with its
                # local rank 0 (which may simply have stopped after its last step).
                return self._behind_relay(key)
        if self.shard is not None and not self.shard.relays:
            try:
                return self._read(self.shard.watching, key)
            except RuntimeError:  # the shard's relay may be gone with its machine
                return self._behind_relay(key)
        value = self._read(self._watch_store, key)
        if self.shard is not None:
            self.shard.relay(key, value)
        return value

    @staticmethod
    def _read(store: Store, key: str) -> str:
        """The value of `key` in `store`, waited for up to a slice."""
        store.wait([key], _WATCH_SLICE)
        value = store.peek(key)
        if value is None:  # the key came and went: an old step's, deleted since
            raise RuntimeError(f"{key} is gone")
        return value.decode()

    def _behind_relay(self, key: str) -> str:
        """The decision where a relay missed it: in the shard, or the job's store (which
        holds every decision)."""
        stores = [self._watch_store]
        if self.shard is not None:
            stores.insert(0, self.shard.watching)
        for store in stores:
            value = store.peek(key)
            if value is not None:
                return value.decode()
        raise RuntimeError(f"{key} is not decided")
