"""The switch agreement of a planned migration: every committer switches at k, or none.

The executor sends `commit(k)` to each machine of a plan in turn, while training goes
on. A rank accepts k only if it has not passed the boundary after k yet
(`trainmover.runtime.acceptance`), so one commit round can split the ranks: some took
k, one had already trained past it. Ranks that switched at k while another trained on
over the old groups would break the job (the leaver gone, its peers waiting for it). So
a rank's acceptance is not yet the switch; the rendezvous store decides, once per
(plan, k), with one compare-and-set:

    accepted = add("{job}/switch/{plan}/{k}/accepted", 1)      # a committer took k
    if accepted == len(plan.committers()): compare_set(decision, "", "switch")
    ... a committer that refuses k (it passed it, is not ready):
                                           compare_set(decision, "", "drop")

The first write is the decision and every rank reads the same one. A rank that took k
reads it at the boundary after k (the joiner before it waits for state) and switches
only on "switch"; on "drop" it trains on over its old groups and the executor picks a
later k. A refusal is written before it is answered, so a later round never races it.
A rank that waited `timeout_s` for a decision writes "drop" itself (a committer that
never answers): the compare-and-set still leaves exactly one decision.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from trainmover.runtime.storeclient import Store

Decision = Literal["switch", "drop"]
SWITCH: Decision = "switch"
DROP: Decision = "drop"
#: How often a rank at k looks for a decision that is not there yet.
_POLL_S = 0.02


class SwitchVote:
    """The store's side of the switch agreement for one plan (module docstring)."""

    def __init__(self, job: str, plan_id: str, store: Callable[[], Store]):
        self.job, self.plan_id = job, plan_id
        #: A fresh client of the rendezvous store (callers run on different threads).
        self._store = store

    def key(self, step: int, what: str) -> str:
        return f"{self.job}/switch/{self.plan_id}/{step}/{what}"

    def accept(self, step: int, committers: int) -> None:
        """This committer took k = `step`; the last of `committers` decides "switch"."""
        self._store().vote(
            self.key(step, "accepted"), committers, self.key(step, "decision"), SWITCH
        )

    def refuse(self, step: int) -> None:
        """This rank refused k: nobody switches at it."""
        self._store().compare_set(self.key(step, "decision"), "", DROP)

    def decision(
        self, step: int, keep_waiting: Callable[[], bool], timeout_s: float
    ) -> Decision | None:
        """The decision for k, waited for while `keep_waiting()` holds (None once it does
        not and k is still undecided: a recovery came, or k was replaced). After `timeout_s` without one, this
        rank decides "drop" unless another decision came first."""
        store = self._store()
        key = self.key(step, "decision")
        deadline = time.monotonic() + timeout_s
        while True:
            if store.check([key]):
                return _decision(store.get(key))
            if not keep_waiting():
                return None
            if time.monotonic() >= deadline:
                return _decision(store.compare_set(key, "", DROP))
            # Polled, not waited on: a timed-out store wait logs a warning every slice,
            # and a decision is normally there before any rank reaches k.
            time.sleep(_POLL_S)


def _decision(value: bytes) -> Decision:
    text = value.decode()
    if text not in (SWITCH, DROP):
        raise RuntimeError(f"switch decision {text!r} is neither {SWITCH!r} nor {DROP!r}")
    return SWITCH if text == SWITCH else DROP
