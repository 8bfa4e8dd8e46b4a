"""The switch step of a planned migration: picking k, and judging the answers to commit(k).

k must lie ahead of every rank when `commit(k)` reaches it, yet the executor records k
before it sends the commit (a restarted executor re-sends the same k), and that durable
write can wait seconds for a stream leader election on a bus cluster while training goes
on; fast steps can outrun a small margin too. So a commit can arrive too late at some
ranks or all: they refuse it (each had already passed k). The ranks themselves agree
that nobody switches at a k one of them refused (`trainmover.runtime.switchvote`), so
such a round, whether every rank refused it or only some, is repeated with a k picked
afresh from the steps the ranks report, its margin doubled each time, for a bounded
number of rounds. Any other refusal (a rank not ready, an unknown plan) fails the
migration; nobody switches at its k either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

TOO_LATE = "too late"
"""A rank's reason for refusing a commit(k) when it already passed the boundary after k."""

COMMIT_ROUNDS = 4
"""How many commit rounds a migration makes before a too-late refusal fails it."""


def switch_step(passed: Iterable[int], margin: int, round_: int = 0) -> int:
    """k for commit round `round_` (0 first): `margin` steps past the furthest of the
    ranks' `passed` steps, the margin doubled for each round already refused."""
    steps = list(passed)
    if not steps:
        raise ValueError("no rank reported a step to pick the switch step from")
    if margin < 1:
        raise ValueError(f"switch margin must be at least 1 step, got {margin}")
    return max(steps) + margin * 2**round_


Verdict = Literal["accepted", "again", "failed"]
"""accepted: every rank switches after k; again: nobody took k, pick a later one;
failed: the migration cannot switch at k."""


@dataclass(frozen=True)
class CommitOutcome:
    verdict: Verdict
    #: The furthest step any rank reported having passed (for the next k on `again`).
    passed: int
    detail: str = ""


def judge_commit(answers: Mapping[str, Mapping[str, Any]], joiners: Iterable[str]) -> CommitOutcome:
    """The outcome of one commit round from each machine's answer (`accepted`: its ranks
    that took k; `refused`: rank -> reason; `passed`: its furthest passed step). A joiner
    takes any k (it waits for the leaver's state at it), so it never decides `again`."""
    joining = set(joiners)
    passed = max((int(a.get("passed", 0)) for a in answers.values()), default=0)
    refused = {
        rank: str(reason)
        for answer in answers.values()
        for rank, reason in dict(answer.get("refused", {})).items()
    }
    if not refused:
        return CommitOutcome("accepted", passed)
    detail = ", ".join(f"{rank}: {reason}" for rank, reason in sorted(refused.items()))
    if any(reason != TOO_LATE for reason in refused.values()):
        return CommitOutcome("failed", passed, f"refused ({detail})")
    took = [m for m, a in answers.items() if m not in joining and int(a.get("accepted", 0)) > 0]
    if took:  # they drop k: a committer refused it
        detail = f"split: {', '.join(sorted(took))} took k, others too late ({detail})"
    return CommitOutcome("again", passed, detail)
