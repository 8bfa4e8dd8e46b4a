"""Permission violations the server reports, surfaced to the caller as PermissionDenied.

nats-server answers a publish or subscribe outside a user's permissions with
`-ERR 'Permissions Violation for Publish to "<subject>"'` and drops it; nats-py hands
that to the connection's error callback only, so a denied JetStream publish or API
request would just time out, and a denied plain publish would vanish. `bus.connect`
feeds every error to this connection's `Denials`; bus helpers then race their work
against a violation for the subjects they use, so the caller gets "permission denied"
at once. The -ERR comes before the reply to any later request of the same connection
(the server handles a connection's protocol in order), so a flush is enough to learn
whether a plain publish or a subscribe was refused.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

_VIOLATION = re.compile(
    r"permissions violation for (publish|subscription) to \"?([^\"'\s]+)\"?", re.IGNORECASE
)


class PermissionDenied(PermissionError):
    """The bus refused a publish or subscribe of this connection's user; one line."""

    def __init__(self, action: str, subject: str, user: str = "") -> None:
        self.action = action
        self.subject = subject
        who = f" for {user}" if user else ""
        super().__init__(f"permission denied{who}: may not {action} to {subject!r}")


@dataclass(frozen=True)
class Violation:
    action: str  # "publish" or "subscribe"
    subject: str


def parse_violation(err: object) -> Violation | None:
    """The violation an error callback got, or None for any other error."""
    m = _VIOLATION.search(str(err))
    if m is None:
        return None
    return Violation("publish" if m.group(1).lower() == "publish" else "subscribe", m.group(2))


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` is one token, a final `>` is one or more.

    Case-insensitive: nats-py lower-cases the server's error text, subject included.
    """
    p, s = pattern.lower().split("."), subject.lower().split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


class Denials:
    """The violations of one connection, and waiters for the next matching one."""

    def __init__(self, user: str = "") -> None:
        self.user = user
        self.count = 0
        self._waiters: list[tuple[tuple[str, ...], asyncio.Future[Violation]]] = []
        self.recent: list[Violation] = []

    def report(self, err: object) -> Violation | None:
        """Records `err` if it is a violation; wakes whoever waits on its subject."""
        violation = parse_violation(err)
        if violation is None:
            return None
        self.count += 1
        self.recent = [*self.recent[-31:], violation]
        for patterns, fut in list(self._waiters):
            if not fut.done() and any(subject_matches(p, violation.subject) for p in patterns):
                fut.set_result(violation)
        return violation

    def error(self, violation: Violation) -> PermissionDenied:
        return PermissionDenied(violation.action, violation.subject, self.user)

    async def guard(self, work: Awaitable[T], subjects: Iterable[str]) -> T:
        """Runs `work`; raises PermissionDenied if a violation on one of `subjects`
        (NATS patterns) is reported before it completes."""
        patterns = tuple(subjects)
        fut: asyncio.Future[Violation] = asyncio.get_running_loop().create_future()
        entry = (patterns, fut)
        self._waiters.append(entry)
        task: asyncio.Future[T] = asyncio.ensure_future(work)
        try:
            pending: set[asyncio.Future[Any]] = {task, fut}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            violation = fut.result()
            # Name the subject as the caller spelled it (the error text was lower-cased).
            for pattern in patterns:
                if pattern.lower() == violation.subject.lower():
                    violation = Violation(violation.action, pattern)
            raise self.error(violation)
        finally:
            self._waiters.remove(entry)
            if not task.done():
                task.cancel()

    def since(self, mark: int) -> list[Violation]:
        """Violations reported after `count` was `mark` (within the recent window)."""
        new = self.count - mark
        return self.recent[-new:] if new > 0 else []


_registry: weakref.WeakKeyDictionary[Any, Denials] = weakref.WeakKeyDictionary()


def adopt(nc: Any, denials: Denials) -> None:
    """Makes `denials` (fed by `nc`'s error callback) the Denials of connection `nc`."""
    _registry[nc] = denials


def of(nc: Any) -> Denials:
    """The Denials of `nc`; a fresh, never-reporting one for a connection made elsewhere
    (its error callback does not feed it, so its refusals show as timeouts)."""
    found = _registry.get(nc)
    if found is None:
        found = _registry[nc] = Denials()
    return found
