"""cancel_and_wait: a stop ends even when a task loses a cancellation; gather_all: the
first failure ends the others before it is raised."""

from __future__ import annotations

import asyncio

import pytest

from trainmover.tasks import cancel_and_wait, gather_all


async def test_a_task_that_lost_a_cancellation_is_cancelled_again() -> None:
    # What Python 3.11's wait_for does when the cancel lands as its future completes:
    # the CancelledError never reaches the loop, which goes on.
    lost = 0
    looping = asyncio.Event()

    async def loop_losing_one_cancel() -> None:
        nonlocal lost
        while True:
            looping.set()
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if lost == 0:
                    lost += 1
                    continue
                raise

    task = asyncio.create_task(loop_losing_one_cancel())
    await looping.wait()
    left = await cancel_and_wait([task], owner="test", grace_s=0.05, timeout_s=5)
    assert left == [] and task.cancelled() and lost == 1


async def test_cleanup_in_finally_gets_the_grace_period() -> None:
    cleaned = asyncio.Event()
    started = asyncio.Event()

    async def with_cleanup() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.2)  # e.g. telling a peer we are leaving
            cleaned.set()

    task = asyncio.create_task(with_cleanup())
    await started.wait()
    assert await cancel_and_wait([task], owner="test", grace_s=2, timeout_s=5) == []
    assert cleaned.is_set()


async def test_a_task_that_never_ends_is_returned_after_the_timeout() -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def stubborn() -> None:
        started.set()
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn())
    await started.wait()
    left = await cancel_and_wait([task], owner="test", grace_s=0.05, timeout_s=0.3)
    assert left == [task] and not task.done()
    release.set()
    await task


async def test_a_task_failing_as_it_stops_does_not_fail_the_stop() -> None:
    started = asyncio.Event()

    async def fails_on_cancel() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await started.wait()
    assert await cancel_and_wait([task], owner="test") == []
    assert isinstance(task.exception(), RuntimeError)


async def test_gather_all_gives_every_result_in_order() -> None:
    gates = [asyncio.Event() for _ in range(3)]

    async def after(i: int) -> int:
        await gates[i].wait()
        if i > 0:
            gates[i - 1].set()  # they end last to first
        return i + 1

    results = asyncio.ensure_future(gather_all([after(0), after(1), after(2)]))
    gates[2].set()
    assert await results == [1, 2, 3]


async def test_the_first_failure_ends_the_others_before_it_is_raised() -> None:
    waiting = asyncio.Event()
    ended: list[str] = []

    async def waits_forever() -> None:
        try:
            waiting.set()
            await asyncio.Event().wait()
        finally:
            ended.append("waiter")

    async def fails() -> None:
        await waiting.wait()
        raise RuntimeError("machine m3 refused")

    with pytest.raises(RuntimeError, match="m3 refused"):
        await gather_all([waits_forever(), fails()])
    assert ended == ["waiter"]
