"""The progress board: who holds a step back, from real store entries and pure rules."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from trainmover.runtime.progress import Entry, Progress, ProgressBoard, StallWatch, judge
from trainmover.runtime.steptime import WAITS


def _entry(
    machine: str, voted: int, waiting: bool, n: int, epoch: str = "e1", done: int = 3
) -> Entry:
    return Entry(
        machine=machine, epoch=epoch, step=8, voted=voted, waiting=waiting, counter=n, done=done
    )


def test_judge_names_frozen_and_computing_ranks_not_their_victims() -> None:
    first = {
        0: _entry("m0", 8, True, 10),  # voted
        1: _entry("m0", 8, True, 10),
        2: _entry("m1", 7, False, 5),  # frozen: its counter does not move
        3: _entry("m1", 7, True, 5),
        4: _entry("m2", 7, False, 3),  # spinning outside any collective
        5: _entry("m2", 7, True, 3),  # waiting in a collective: a victim
        6: None,
        7: _entry("m3", 7, False, 1, done=0),  # its first step of the epoch: not judged
    }
    second = {
        **first,
        0: _entry("m0", 8, True, 12),
        1: _entry("m0", 8, True, 12),
        4: _entry("m2", 7, False, 5),
        5: _entry("m2", 7, True, 5),
        7: _entry("m3", 7, False, 2, done=0),
    }
    culprits, doing = judge("e1", 8, first, second)
    assert culprits == {"m1": [2, 3], "m2": [4]}
    assert doing == {2: "frozen", 3: "frozen", 4: "computing", 5: "waiting", 7: "starting"}
    # A vote of an earlier epoch is not a vote of this one.
    stale = {0: _entry("m0", 9, True, 1, epoch="e0")}
    assert judge("e1", 8, stale, stale)[0] == {"m0": [0]}
    # Everyone voted: nobody to name.
    done = {r: _entry("m0", 8, True, 1) for r in range(4)}
    assert judge("e1", 8, done, done) == ({}, {})


def test_the_threshold_follows_the_median_step_above_a_floor() -> None:
    class Board:
        progress = Progress()

    judged: list[object] = []
    watch = StallWatch(board=Board(), report=judged.append, floor_s=2.0, factor=5.0)  # type: ignore[arg-type]
    assert watch.threshold_s() == 2.0
    watch.stalled("e0", 1, 100.0)  # no step timed yet: nothing to judge against
    for seconds in (0.1, 0.1, 0.2):
        watch.step_done(seconds)
    assert watch.threshold_s() == 2.0 and watch.board.progress.done == 3
    for seconds in (1.0, 1.0, 1.0, 1.0):
        watch.step_done(seconds)
    assert watch.threshold_s() == 5.0
    assert judged == []


def test_a_stopped_beacon_is_seen_frozen_on_a_real_store() -> None:
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    address = f"127.0.0.1:{host.port}"
    boards = [ProgressBoard(address, "j", r, 3, f"m{r}", interval_s=0.05) for r in range(3)]
    try:
        for board in boards:
            board.progress.epoch, board.progress.step = "e0", 5
        boards[0].progress.voted = 5
        boards[2].progress.done = 2  # past its first step: judged as computing
        boards[1].close()  # a stopped process: its entry stays as it was
        stall = None
        while stall is None:  # entries appear within one interval
            stall = boards[0].examine("e0", 5, waited_s=3.0, median_step_s=0.1)
        assert set(stall.culprits) == {"m1", "m2"}
        assert "frozen" in stall.reason and "computing" in stall.reason
        assert "did not reach the vote of step 5" in stall.reason
        # One rank judges a step: the first claim wins.
        assert boards[0].claim("e0", 5, 1) and not boards[2].claim("e0", 5, 1)
    finally:
        for board in boards:
            board.close()


def test_waits_are_seen_from_another_thread() -> None:
    me = threading.get_ident()
    assert not WAITS.is_waiting(me)
    seen: list[bool] = []
    with WAITS.waiting():
        t = threading.Thread(target=lambda: seen.append(WAITS.is_waiting(me)))
        t.start()
        t.join()
    assert seen == [True] and not WAITS.is_waiting(me)
