"""The progress board: who holds a step back, from real store entries and pure rules."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from trainmover.runtime.control import StallEvent
from trainmover.runtime.machinevote import MachineStore
from trainmover.runtime.progress import (
    GAP_BEATS,
    INTERVAL_S,
    Entry,
    Progress,
    ProgressBoard,
    StallWatch,
    judge,
)
from trainmover.runtime.steptime import WAITS
from trainmover.runtime.tcpstore import serve


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
    assert doing == {2: "silent", 3: "silent", 4: "computing", 5: "waiting", 7: "starting"}
    # Outside a collective in the second read only, or a step further on: it moves.
    left_a_wait = {**second, 4: _entry("m2", 7, False, 5), 5: _entry("m2", 7, False, 5)}
    culprits, doing = judge("e1", 8, {**first, 5: _entry("m2", 7, True, 3)}, left_a_wait)
    assert culprits == {"m1": [2, 3], "m2": [4]} and doing[5] == "progressing"
    one_more = {**second, 4: _entry("m2", 7, False, 5, done=4)}
    culprits, doing = judge("e1", 8, first, one_more)
    assert culprits == {"m1": [2, 3]} and doing[4] == "progressing"
    # A vote of an earlier epoch is not a vote of this one.
    stale = {0: _entry("m0", 9, True, 1, epoch="e0")}
    assert judge("e1", 8, stale, stale)[0] == {"m0": [0]}
    # Everyone voted: nobody to name.
    done = {r: _entry("m0", 8, True, 1) for r in range(4)}
    assert judge("e1", 8, done, done) == ({}, {})


def test_a_rank_starved_of_cpu_is_not_named_one_spinning_is() -> None:
    """Two ranks outside any collective for the whole judgement; one of them waited for a
    CPU most of the time between the reads (an overloaded host), the other ran."""

    def at(machine: str, n: int, queued: float) -> Entry:
        return Entry(machine, "e1", 8, 7, False, n, 3, queued=queued)

    first = {0: at("m0", 1, 10.0), 1: at("m1", 1, 10.0)}
    second = {0: at("m0", 3, 10.4), 1: at("m1", 3, 10.01)}
    culprits, doing = judge("e1", 8, first, second, between_s=0.5)
    assert culprits == {"m1": [1]}
    assert doing == {0: "starved", 1: "computing"}
    # Without the time between the reads, nothing tells starved from computing.
    assert judge("e1", 8, {0: first[0]}, {0: second[0]})[0] == {"m0": [0]}


def test_ranks_computing_on_several_machines_are_slow_not_named() -> None:
    """Ranks of three machines outside any collective in the same step, for the whole
    judgement, none of them queued for a CPU: the step is slow everywhere (the job's own
    work, a loaded host), not hung on one machine. A silent rank is still named."""

    def at(machine: str, local: int, voted: int, n: int) -> Entry:
        return Entry(machine, "e1", 4, voted, voted >= 4, n, 3, local)

    first = {
        0: at("m0", 0, 3, 1),
        1: at("m0", 1, 3, 1),
        2: at("m1", 0, 3, 1),
        3: at("m1", 1, 4, 1),  # voted: the judge
        4: at("m2", 0, 3, 1),
        5: at("m3", 0, 3, 1),
    }
    second = {r: Entry(**{**e.__dict__, "counter": 5}) for r, e in first.items()}
    culprits, doing = judge("e1", 4, first, second, between_s=1.0)
    assert culprits == {}
    assert doing == {0: "slow", 1: "slow", 2: "slow", 4: "slow", 5: "slow"}
    # One of those machines stopped: named for its silent rank, its computing one is not.
    frozen = {**second, 5: first[5]}
    culprits, doing = judge("e1", 4, first, frozen, between_s=1.0)
    assert culprits == {"m3": [5]} and doing[5] == "silent" and doing[4] == "slow"
    # Only one machine's ranks computing: that machine is named.
    others_voted = {
        r: at(e.machine, e.local_rank, 4 if e.machine != "m0" else 3, 5) for r, e in first.items()
    }
    assert judge("e1", 4, first, others_voted, between_s=1.0)[0] == {"m0": [0, 1]}


def test_a_rank_waiting_on_peers_that_left_the_step_is_blocked_not_a_victim() -> None:
    def at(machine: str, local: int, voted: int, n: int, on: tuple[str, ...] = ()) -> Entry:
        return Entry(machine, "e1", 8, voted, bool(on) or voted >= 8, n, 3, local, on)

    first = {
        0: at("m0", 0, 8, 1),
        1: at("m0", 1, 7, 1, on=("m0/0",)),  # its TP peer voted: nobody will answer
        2: at("m1", 0, 7, 1, on=("m0/1",)),  # waits on the blocked rank: a victim
        3: at("m1", 1, 7, 1, on=("m1/0", "m0/1")),  # one of its peers voted, one did not
    }
    second = {r: Entry(**{**e.__dict__, "counter": 2}) for r, e in first.items()}
    culprits, doing = judge("e1", 8, first, second)
    assert culprits == {"m0": [1]}
    assert doing == {1: "blocked", 2: "waiting", 3: "waiting"}
    # The wait changed between the reads: not judged blocked on one sighting.
    moved = {**first, 1: at("m0", 1, 7, 1, on=("m1/0",))}
    assert judge("e1", 8, moved, second)[0] == {}
    # Its threads queued for a CPU most of the time between the reads: the answer may be
    # in its socket, unread. Judged again later, not named now.
    starved = {**second, 1: Entry(**{**second[1].__dict__, "process_queued": 0.6})}
    culprits, doing = judge("e1", 8, first, starved, between_s=1.0)
    assert culprits == {} and doing[1] == "starved"
    assert judge("e1", 8, first, starved, between_s=2.0)[0] == {"m0": [1]}


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


class _ScriptedBoard:
    """A board whose reads are scripted: enough to see when the watch reads and judges."""

    interval_s = 0.25
    moved_at = float("-inf")

    def __init__(self) -> None:
        self.progress = Progress(done=3)
        self.claims: list[tuple[str, int, int]] = []
        self.reads = 0
        self.examined: list[float] = []

    def claim(self, epoch: str, step: int, attempt: int) -> bool:
        self.claims.append((epoch, step, attempt))
        return True

    def read(self) -> dict[int, Entry | None]:
        self.reads += 1
        return {}

    def examine(self, epoch, step, first, waited_s, median_step_s, first_age_s):  # type: ignore[no-untyped-def]
        self.examined.append(waited_s)
        return None


def test_nobody_is_judged_while_the_board_refills_after_a_store_move(monkeypatch) -> None:
    board = _ScriptedBoard()
    watch = StallWatch(board=board, report=lambda s: None, floor_s=1.5)  # type: ignore[arg-type]
    for seconds in (0.1, 0.1, 0.1):
        watch.step_done(seconds)
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    board.moved_at = 99.0  # everyone waited for the store: the wait is not a stall
    watch.stalled("e0", 7, 3.0)
    assert board.claims == [] and board.reads == 0
    clock[0] = 99.0 + 1.5 + GAP_BEATS * INTERVAL_S  # threshold and the reads' gap later
    watch.stalled("e0", 7, 5.0)
    assert board.claims == [("e0", 7, 4)] and board.reads == 1


def test_the_judge_reads_ahead_so_its_verdict_falls_on_the_threshold(monkeypatch) -> None:
    board = _ScriptedBoard()
    watch = StallWatch(board=board, report=lambda s: None, floor_s=1.5)  # type: ignore[arg-type]
    for seconds in (0.1, 0.1, 0.1):
        watch.step_done(seconds)
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    assert GAP_BEATS * INTERVAL_S == 1.0  # the timings below
    clock[0] += 0.25
    watch.stalled("e0", 7, 0.25)
    assert board.claims == [] and board.reads == 0
    # The reads' gap before the threshold: claimed, first read.
    clock[0] += 0.25
    watch.stalled("e0", 7, 0.5)
    assert board.claims == [("e0", 7, 1)] and board.reads == 1 and board.examined == []
    for waited in (0.75, 1.0, 1.25):
        clock[0] += 0.25
        watch.stalled("e0", 7, waited)
    assert board.examined == []
    clock[0] += 0.25
    watch.stalled("e0", 7, 1.5)  # the threshold: judged now, not a gap later
    assert board.examined == [1.5]
    # Nobody named: the next attempt one threshold later, claimed anew.
    clock[0] += 1.0
    watch.stalled("e0", 7, 2.5)
    assert board.claims[-1] == ("e0", 7, 2) and board.examined == [1.5]
    clock[0] += 0.5
    watch.stalled("e0", 7, 3.0)
    assert board.examined == [1.5]  # the first read of this attempt is 0.5 s old
    clock[0] += 0.5
    watch.stalled("e0", 7, 3.5)
    assert board.examined == [1.5, 3.5]
    # The step ended: a wait in the next step starts afresh.
    clock[0] += 0.25
    watch.stalled("e0", 8, 0.25)
    assert board.claims[-1] == ("e0", 7, 2)


@contextlib.contextmanager
def _boards(
    world: int, per_machine: int = 1, host: dist.TCPStore | None = None
) -> Iterator[list[ProgressBoard]]:
    """`world` ranks' beacons on a real store, each in step 5 of epoch e0; with
    `per_machine` > 1, machines of that many ranks fold their entries in a machine store.

    The job's store listens as the runtime's do (`tcpstore.serve`): one that c10d
    listens for itself, dual-stack, names each of the boards' connections with a name
    lookup on its one thread, and a lookup the resolver drops held every board 5 s.

    Each board is made on a thread of its own that stays alive and never waits: its
    rank's training thread, busy computing. Made on the test's thread, every board would
    see the test's own reads of the store as its training thread waiting."""
    host = host or serve("127.0.0.1", timeout_s=10)
    address = f"127.0.0.1:{host.port}"
    machines = [MachineStore() for _ in range(world // per_machine)] if per_machine > 1 else []
    boards: list[ProgressBoard | None] = [None] * world
    made = [threading.Event() for _ in range(world)]
    finished = threading.Event()

    def training(rank: int) -> None:
        slot, local = divmod(rank, per_machine)
        boards[rank] = ProgressBoard(
            address,
            "j",
            rank,
            world,
            f"m{slot}",
            local,
            interval_s=0.05,
            machine_store=machines[slot].address if machines else None,
            local_world=per_machine,
        )
        made[rank].set()
        finished.wait()

    threads = [threading.Thread(target=training, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for event in made:
        assert event.wait(10), "a board was not made"
    ready = [board for board in boards if board is not None]
    for board in ready:
        board.progress.epoch, board.progress.step = "e0", 5
    try:
        yield ready
    finally:
        finished.set()
        for board in ready:
            board.close()


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.01)


def test_a_stopped_beacon_is_seen_frozen_on_a_real_store() -> None:
    with _boards(3) as boards:
        boards[0].progress.voted = 5
        boards[2].progress.done = 2  # past its first step: judged as computing

        def written() -> bool:
            entries = boards[0].read()
            computing = entries[2]
            return None not in entries.values() and (
                computing is not None and computing.progress == ("e0", 5, 2)
            )

        _until(written, "entry of every rank")
        boards[1].close()  # a stopped process: its entry stays as it was
        stall = None
        while stall is None:  # entries appear within one interval
            first = boards[0].read()
            time.sleep(2 * boards[0].interval_s)  # the judge's two reads, apart
            stall = boards[0].examine("e0", 5, first, waited_s=3.0, median_step_s=0.1)
        assert set(stall.culprits) == {"m1", "m2"}
        assert "silent" in stall.reason and "computing" in stall.reason
        assert stall.silent == ["m1"]  # the health monitor tells stopped from starved
        assert "did not reach the vote of step 5" in stall.reason
        # One rank judges a step: the first claim wins.
        assert boards[0].claim("e0", 5, 1) and not boards[2].claim("e0", 5, 1)


def test_a_leaver_that_handed_its_role_over_is_not_judged() -> None:
    with _boards(2) as boards:
        for board in boards:
            board.progress.done = 2
        boards[0].progress.voted = 5
        _until(lambda: boards[0].read()[1] is not None, "entry of the leaver")
        boards[1].leave()  # at its switch: its joiner has not written the entry yet
        assert boards[0].read()[1] is None
        first = boards[0].read()
        time.sleep(2 * boards[0].interval_s)  # the judge's two reads, apart
        assert boards[0].examine("e0", 5, first, waited_s=3.0, median_step_s=0.1) is None


def test_a_machine_writes_its_ranks_entries_as_one_and_each_rank_is_still_judged() -> None:
    job = serve("127.0.0.1", timeout_s=10)
    with _boards(6, per_machine=2, host=job) as boards:
        for board in boards:
            board.progress.done = 2
        for board in boards[:4]:
            board.progress.voted = 5

        def written() -> bool:
            entries = boards[3].read().values()
            return all(e is not None and e.progress == ("e0", 5, 2) for e in entries)

        _until(written, "entry of every rank")
        # The job's store holds one entry per machine, none per rank.
        assert [job.check([f"j/progress/m{m}"]) for m in range(3)] == [True] * 3
        assert not any(job.check([f"j/progress/{r}"]) for r in range(6))
        entries = boards[3].read()
        refs = [e.ref for e in entries.values() if e]
        assert refs == ["m0/0", "m0/1", "m1/0", "m1/1", "m2/0", "m2/1"]
        # Machine 2's local rank 1 stops (frozen); its local rank 0 goes on computing
        # in step 5: both are named, each for what it does.
        boards[5].close()
        verdicts: list[StallEvent | None] = []

        def judged_silent() -> bool:
            # Its last beat reaches the job's store with its local rank 0's next one: a
            # judgement across that copy still sees it move.
            first = boards[0].read()
            time.sleep(2 * boards[0].interval_s)
            verdicts.append(boards[0].examine("e0", 5, first, waited_s=3.0, median_step_s=0.1))
            return verdicts[-1] is not None and "silent" in verdicts[-1].reason

        _until(judged_silent, "verdict naming the stopped rank silent")
        stall = verdicts[-1]
        assert stall is not None and stall.culprits == {"m2": [4, 5]}
        assert "computing" in stall.reason
        assert stall.silent == []  # its local rank 0 computes: not silent as a whole
        # A machine that hands its role over takes its one entry with it.
        boards[3].leave()
        boards[2].leave()
        assert not job.check(["j/progress/m1"])
        assert boards[0].read()[2] is None and boards[0].read()[3] is None


def test_a_machine_entry_that_is_not_one_reads_as_none_written() -> None:
    job = serve("127.0.0.1", timeout_s=10)
    with _boards(4, per_machine=2, host=job) as boards:
        _until(lambda: None not in boards[0].read().values(), "entry of every rank")
        boards[2].close()  # machine 1's local rank 0: its key is written no more
        for garbage in ("[1, 2]", '{"x": 1}', '{"3": [1]}', "not json"):
            job.set("j/progress/m1", garbage)
            entries = boards[0].read()
            assert entries[2] is None and entries[3] is None, garbage
            assert entries[0] is not None and entries[1] is not None


def test_waits_are_seen_from_another_thread() -> None:
    me = threading.get_ident()
    assert not WAITS.is_waiting(me)
    seen: list[bool] = []
    with WAITS.waiting():
        t = threading.Thread(target=lambda: seen.append(WAITS.is_waiting(me)))
        t.start()
        t.join()
    assert seen == [True] and not WAITS.is_waiting(me)
