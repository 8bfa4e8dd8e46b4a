"""Stopping asyncio tasks so that a service's stop always ends.

A single `task.cancel()` is not always enough on Python 3.11: `asyncio.wait_for` drops a
cancellation that arrives just as the future it waits on completes (cpython gh-86296),
and nats-py waits that way on every flush, request and fetch. A loop around such a call
then carries on as if never cancelled, and a stop that awaits it hangs for good (seen
in CI: a heartbeat loop flushing every 50 ms held a test's teardown for 5 minutes).
`cancel_and_wait` cancels again until the task ends, and names what would not.

`gather_all` awaits several at once, and the first to fail ends the others: what
is left running after a failure would outlive its caller.

`until_set` waits for a thread's Event without asyncio's default executor, whose
threads the loop joins when it closes: one still waiting there held a stopped service's
exit until it was killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from trainmover.logs import get_logger

T = TypeVar("T")

log = get_logger("tasks")

RECANCEL_EVERY_S = 0.5
"""After the first grace period, how often a task that is still running is cancelled
again (a task cleaning up in a `finally` gets the grace period undisturbed)."""


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]],
    *,
    owner: str,
    grace_s: float = 2.0,
    timeout_s: float = 10.0,
) -> list[asyncio.Future[Any]]:
    """Cancels `tasks` and waits until they end, at most `timeout_s` seconds in all.

    Returns the tasks still running after that (each logged with where it waits);
    exceptions of the tasks that ended are consumed: a stopping service has no use
    for them, and asyncio would otherwise report them as never retrieved.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = {t for t in tasks if not t.done()}
    wait_s = grace_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        done, pending = await asyncio.wait(pending, timeout=min(wait_s, left))
        for task in done:
            if not task.cancelled():
                task.exception()
        wait_s = RECANCEL_EVERY_S
    for task in pending:
        log.error(
            "task_did_not_stop",
            owner=owner,
            task=task.get_name() if isinstance(task, asyncio.Task) else repr(task),
            where=_where(task),
            timeout_s=timeout_s,
        )
    return list(pending)


def _where(task: asyncio.Future[Any]) -> str:
    if not isinstance(task, asyncio.Task):
        return "?"
    frames = task.get_stack(limit=1)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """The results of `aws`, run together; the first to raise cancels the others,
    which are waited out before its exception propagates."""
    futures = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*futures))
    except BaseException:
        for future in futures:
            future.cancel()
        await asyncio.gather(*futures, return_exceptions=True)
        raise


async def until_set(event: threading.Event) -> None:
    """Returns once `event` is set, waited for on a daemon thread of its own (module
    docstring): a loop that closes meanwhile leaves it behind."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def wait() -> None:
        event.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle)

    threading.Thread(target=wait, name="event-wait", daemon=True).start()
    await done
