"""Commit votes for tests: every rank's agreement votes on a thread of its own."""

from __future__ import annotations

import threading

from trainmover.runtime.abort import StepAborted
from trainmover.runtime.agreement import CommitAgreement


def vote_all(ranks: list[CommitAgreement], step: int) -> list[str]:
    """Each rank begins and votes for `step` at once; each one's outcome, in order."""
    outcome = [""] * len(ranks)

    def vote(i: int) -> None:
        ranks[i].begin(step)
        try:
            ranks[i].vote(step)
            outcome[i] = "commit"
        except StepAborted:
            outcome[i] = "abort"

    threads = [threading.Thread(target=vote, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome
