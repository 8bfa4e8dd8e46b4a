"""Naming the ranks that hold a step back: a progress board in the rendezvous store.

A hung machine (frozen, deadlocked, spinning, cut off) does not crash: its peers wait on
it in a collective or in the commit vote, and nothing fails until a timeout. A waiting
rank knows that a step is held back; what it needs is *who*. Every rank keeps an entry on the job's progress board in the store,
rewritten by a daemon thread every `interval_s` (one small write; training never waits
for it):

    {job}/progress/{rank} = {"m": machine, "l": local rank, "e": epoch,
                             "s": step in flight, "v": last step voted,
                             "w": waiting in a collective, "o": the ranks it waits on,
                             "q": the training thread's seconds waiting for a CPU,
                             "p": all its threads' seconds waiting for a CPU,
                             "n": a counter that grows with every write}

Where a machine has several ranks and a store of its own (`trainmover.runtime.machinevote`),
each rank writes its entry there, and local rank 0 writes its machine's entries to the
job's store as one (`{job}/progress/m{machine slot}`): the job's store takes one write
per machine and beat, whatever the ranks per machine. A frozen local rank 0 stops its
machine's entries together; the machine is what is replaced anyway.

A rank that has waited longer than `threshold` (a few times the recent median step,
bounded below by a floor) in a collective of step k, or for the decision of k after its
vote, claims the judgement of (epoch, k) in the store (one rank judges) and reads the
board twice, `GAP_BEATS` beacon intervals apart, the second time at the threshold. Most hangs hold
every other rank in a collective before anyone votes (the gradient all-reduce comes
first), so waiting anywhere counts.
A rank that has not voted for k is

- *silent* when its counter did not move (the whole process is stopped, or cut off
  from the store): a culprit, unless the health monitor finds in its machine's
  heartbeats that the process was only starved of a CPU (the report lists it `silent`);
- *computing* when it is not waiting in a collective (spinning outside any collective,
  stuck in its own code) and past its first step of the epoch, in both reads and at
  the same step: a culprit;
- *progressing* when it would be computing but moved between the two reads (it left a
  wait, or began another step): not named;
- *starved* when it would be computing but its training thread spent most of the time
  between the two reads runnable and waiting for a CPU (an overloaded host, not a hung
  rank): not named; the judgement comes again at the next threshold;
- *slow* when it would be computing but ranks on more than one machine are computing
  in the same judgement: independent hangs in users' code on two machines in one step
  are far rarer than a cause they share (a loaded host, a slow file system, the step's
  own work), and a replacement, which runs the same code, would not help: not named;
  the judgement comes again at the next threshold;
- *blocked* when it waits in a collective on ranks that have all voted for k (they
  left the step; nobody will ever answer it: a deadlocked worker, or its side of the
  link lost the data): a culprit; unless its process's threads spent most of the time
  between the reads waiting for a CPU: the answer may be in its socket with the thread
  that would read it queued (starved, not named; judged again at the next threshold);
- *waiting* in a collective otherwise: a victim of a culprit (its peer holds it back).

The machines of the culprits are reported (a `StallEvent`) through the sidecar to the
health-monitor, which declares them failed; the fence and the recovery follow as for a
crash. When every rank is slow alike, voters do not wait long and nobody is named; a
machine that is slow but progressing finishes its step before the threshold and stays a
straggler case.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainmover.runtime.control import StallEvent
from trainmover.runtime.machinevote import client_of
from trainmover.runtime.steptime import WAITS, SchedStat, process_run_queue_s
from trainmover.runtime.storeclient import ABSENT, Store

#: How often each rank rewrites its entry on the board.
INTERVAL_S = 0.25
#: Steps a rank must have timed before it judges others.
MIN_HISTORY = 3
#: Beacon intervals between the judge's two reads: a rank is silent only once it missed
#: that many beats in a row, more than an overloaded host starves a live process of
#: (two did: a healthy machine was named silent). The first read is taken that long
#: before the threshold, so the verdict still comes at the threshold.
GAP_BEATS = 4
#: The share of the time between the two reads spent waiting for a CPU (by the training
#: thread of a rank outside any collective, by the threads of a blocked rank's process)
#: from which a rank is starved rather than computing or blocked.
STARVED = 0.5


@dataclass
class Progress:
    """What the training thread tells the beacon (plain fields, read by its thread)."""

    epoch: str = "e0"
    step: int = 0
    voted: int = -1
    #: Steps this rank completed in this epoch: its first one (lazy initialisation, a
    #: joiner's first iteration, a loaded host) is not judged as computing too long.
    done: int = 0


@dataclass(frozen=True)
class Entry:
    """One rank's entry as read from the board."""

    machine: str
    epoch: str
    step: int
    voted: int
    waiting: bool
    counter: int
    done: int = 0
    local_rank: int = 0
    #: The ranks ("machine/local_rank") its wait waits on; empty when none is named.
    on: tuple[str, ...] = ()
    #: Seconds its training thread has waited for a CPU (a monotonic total).
    queued: float = 0.0
    #: Seconds all threads of its process have waited for a CPU (summed).
    process_queued: float = 0.0

    @property
    def progress(self) -> tuple[str, int, int]:
        """What moves while the rank trains: (epoch, step in flight, steps done)."""
        return (self.epoch, self.step, self.done)

    @property
    def ref(self) -> str:
        return f"{self.machine}/{self.local_rank}"

    def voted_for(self, epoch: str, step: int) -> bool:
        return self.epoch == epoch and self.voted >= step

    @staticmethod
    def parse(raw: bytes) -> Entry | None:
        try:
            return Entry.from_dict(json.loads(raw))
        except ValueError:
            return None

    @staticmethod
    def from_dict(d: Any) -> Entry | None:
        try:
            return Entry(
                d["m"],
                d["e"],
                int(d["s"]),
                int(d["v"]),
                bool(d["w"]),
                int(d["n"]),
                int(d["f"]),
                int(d.get("l", 0)),
                tuple(str(r) for r in d.get("o", ())),
                float(d.get("q", 0.0)),
                float(d.get("p", 0.0)),
            )
        except (ValueError, KeyError, TypeError):
            return None


def judge(
    epoch: str,
    step: int,
    first: dict[int, Entry | None],
    second: dict[int, Entry | None],
    between_s: float = 0.0,
) -> tuple[dict[str, list[int]], dict[int, str]]:
    """Pure: culprit machine -> ranks, and rank -> what each rank that has not voted for
    `step` in `epoch` is doing ("silent", "computing", "progressing", "starved",
    "slow", "blocked", "waiting"), from two reads `between_s` apart."""
    culprits: dict[str, list[int]] = {}
    doing: dict[int, str] = {}
    voted = {e.ref for e in second.values() if e is not None and e.voted_for(epoch, step)}
    for rank, now in sorted(second.items()):
        before = first.get(rank)
        if now is None:
            continue  # never wrote: not started yet, nothing to say
        if now.voted_for(epoch, step):
            continue
        if before is not None and before.counter == now.counter:
            doing[rank] = "silent"
        elif not now.waiting and now.done > 0:
            if before is None or before.waiting or before.progress != now.progress:
                doing[rank] = "progressing"
                continue
            starved = now.queued - before.queued >= STARVED * between_s
            doing[rank] = "starved" if starved and between_s > 0 else "computing"
            if doing[rank] == "starved":
                continue
        elif now.waiting and now.on and set(now.on) <= voted and before and before.on == now.on:
            # The same wait in both reads, on ranks that left.
            starved = now.process_queued - before.process_queued >= STARVED * between_s
            doing[rank] = "starved" if starved and between_s > 0 else "blocked"
            if doing[rank] == "starved":
                continue
        else:
            # Waiting on someone else, or still in its first step of the epoch.
            doing[rank] = "waiting" if now.waiting else "starting"
            continue
        culprits.setdefault(now.machine, []).append(rank)
    computing = {r for r, what in doing.items() if what == "computing"}
    if len({m for m, ranks in culprits.items() if computing & set(ranks)}) > 1:
        for rank in computing:
            doing[rank] = "slow"
        culprits = {
            m: kept
            for m, ranks in culprits.items()
            if (kept := [r for r in ranks if r not in computing])
        }
    return culprits, doing


def silent_only(ranks: list[int], doing: dict[int, str]) -> bool:
    """True when every one of `ranks` is silent: its machine's process may be stopped,
    cut off, or only starved of a CPU, which the health monitor tells apart from the
    machine's own heartbeats (the judge cannot see into another machine)."""
    return all(doing.get(r) == "silent" for r in ranks)


class ProgressBoard:
    """This rank's beacon on the board, and the judgement of a stalled step."""

    def __init__(
        self,
        store_address: str,
        job: str,
        rank: int,
        world: int,
        machine: str,
        local_rank: int = 0,
        interval_s: float = INTERVAL_S,
        timeout_s: float = 30.0,
        machine_store: str | None = None,
        local_world: int = 1,
    ) -> None:
        """`machine_store`: the address of this rank's machine store, where its machine's
        `local_world` ranks fold their entries (module docstring)."""
        self.job, self.rank, self.world, self.machine = job, rank, world, machine
        self.local_rank = local_rank
        #: Ranks per entry in the job's store: the machine's, or 1.
        self.fold = local_world if machine_store else 1
        # A beat, on its own thread, may wait long: the store's server can stall for
        # seconds after a burst of connections (every rank of a launch connects at once).
        self._local = client_of(machine_store, timeout_s) if machine_store else None
        self.interval_s = interval_s
        self.progress = Progress()
        self._training_thread = threading.get_ident()
        self._training_sched = SchedStat(threading.get_native_id())
        # Entries are rewritten, never re-cast: each rank's next beat fills a new replica.
        self._store = Store(store_address, timeout_s, recast=False)
        #: When the store last moved to another replica (monotonic).
        self.moved_at = float("-inf")
        self._store.share.on_move.append(self._moved)
        self._lock = threading.Lock()  # one store client, two threads
        self._counter = 0
        self._closed = threading.Event()
        self._beacon = threading.Thread(target=self._beat, name="progress-beacon", daemon=True)
        self._beacon.start()

    def key(self, rank: int) -> str:
        return f"{self.job}/progress/{rank}"

    def machine_key(self, slot: int) -> str:
        return f"{self.job}/progress/m{slot}"

    def _own_key(self) -> str | None:
        """This rank's key in the job's store (None: its local rank 0 writes for it)."""
        if self.fold == 1:
            return self.key(self.rank)
        return self.machine_key(self.rank // self.fold) if self.local_rank == 0 else None

    def _moved(self, generation: int, incarnation: str) -> None:
        self.moved_at = time.monotonic()

    def close(self) -> None:
        self._closed.set()

    def leave(self) -> None:
        """This rank hands its role over (a leaver at its switch): its entry goes, or
        its peers, waiting for the joiner's first step, would judge the stopped beacon
        silent and name the leaver's machine. Until the joiner writes the entry anew
        nobody is judged for that rank."""
        self._closed.set()
        self._beacon.join(self.interval_s * 4)
        try:
            if self._local is not None:
                self._local.delete_key(self.key(self.rank))
            key = self._own_key()
            if key is not None:
                with self._lock:
                    self._store.delete_key(key)
        except RuntimeError:
            pass  # the store is away: nobody reads the board meanwhile either

    def _beat(self) -> None:
        while not self._closed.is_set():
            p = self.progress
            self._counter += 1
            entry = {
                "m": self.machine,
                "l": self.local_rank,
                "e": p.epoch,
                "s": p.step,
                "v": p.voted,
                "w": WAITS.is_waiting(self._training_thread),
                "o": WAITS.waiting_on(self._training_thread),
                "q": round(self._training_sched.run_queue_s(), 4),
                "p": round(process_run_queue_s(), 4),
                "n": self._counter,
                "f": p.done,
            }
            try:
                self._write(json.dumps(entry))
            except RuntimeError:
                pass  # the store is away: the judge then sees this rank frozen
            self._closed.wait(self.interval_s)

    def _write(self, entry: str) -> None:
        if self._local is not None:
            self._local.set(self.key(self.rank), entry)
            if self.local_rank != 0:
                return
            entry = self._machine_entries(entry)
        with self._lock:
            # A beat held up past `leave` must not write back the entry it deleted.
            if self._closed.is_set():
                return
            key = self._own_key()
            assert key is not None
            self._store.set(key, entry)

    def _machine_entries(self, own: str) -> str:
        """Local rank 0's entry and those its machine's other ranks wrote, as one."""
        assert self._local is not None
        entries = [f'"{self.rank}":{own}']
        for rank in range(self.rank + 1, self.rank + self.fold):
            raw = self._local.compare_set(self.key(rank), ABSENT, ABSENT).decode()
            if raw != ABSENT:
                entries.append(f'"{rank}":{raw}')
        return "{" + ",".join(entries) + "}"

    def read(self) -> dict[int, Entry | None]:
        """Every rank's entry (None where it has written none yet)."""
        if self.fold == 1:
            keys = [self.key(r) for r in range(self.world)]
        else:
            keys = [self.machine_key(m) for m in range(self.world // self.fold)]
        with self._lock:
            present = [k for k in keys if self._store.check([k])]
            values = self._store.multi_get(present) if present else []
        if self.fold == 1:
            found = dict(zip(present, values, strict=True))
            return {r: Entry.parse(found[k]) if k in found else None for r, k in enumerate(keys)}
        entries: dict[int, Entry | None] = dict.fromkeys(range(self.world))
        for raw in values:
            try:
                machine = json.loads(raw)
                for rank, entry in machine.items():
                    if int(rank) in entries:
                        entries[int(rank)] = Entry.from_dict(entry)
            except (ValueError, AttributeError):
                continue  # not a machine's entries: as if it had written none
        return entries

    def claim(self, epoch: str, step: int, attempt: int) -> bool:
        """True for the one rank that judges (epoch, step) this time."""
        key = f"{self.job}/stall/{epoch}/{step}/{attempt}"
        with self._lock:
            return self._store.compare_set(key, "", str(self.rank)).decode() == str(self.rank)

    def examine(
        self,
        epoch: str,
        step: int,
        first: dict[int, Entry | None],
        waited_s: float,
        median_step_s: float,
        first_age_s: float = 0.0,
    ) -> StallEvent | None:
        """Reads the board again and names the culprits of (epoch, step), if any, from
        this read and `first` (an earlier one, `first_age_s` ago: at least two beacon
        intervals)."""
        culprits, doing = judge(epoch, step, first, self.read(), first_age_s)
        if not culprits:
            return None
        parts = []
        for machine, ranks in sorted(culprits.items()):
            what = sorted({doing[r] for r in ranks})
            listed = ", ".join(f"r{r}" for r in ranks)
            parts.append(f"ranks {listed} of {machine} ({'/'.join(what)})")
        factor = waited_s / median_step_s if median_step_s > 0 else float("inf")
        reason = (
            f"no progress: {'; '.join(parts)} did not reach the vote of step {step} for "
            f"{waited_s:.1f}s, {factor:.0f}x the median step"
        )
        return StallEvent(
            epoch=epoch,
            step=step,
            culprits=culprits,
            silent=[m for m, ranks in sorted(culprits.items()) if silent_only(ranks, doing)],
            reason=reason,
            waited_s=waited_s,
            median_step_s=median_step_s,
            t=time.time(),
        )


@dataclass
class _Pending:
    """A judgement under way: claimed, first read taken, second read due."""

    key: tuple[str, int, int]
    first: dict[int, Entry | None]
    read_at: float


@dataclass
class StallWatch:
    """Decides when a voter judges: after `threshold_s()` of waiting, and again after
    each further threshold while nobody could be named.

    The judge claims the judgement and takes its first read two beacon intervals before
    the threshold, so the second read (the one that tells frozen from alive) falls on
    the threshold itself and the verdict costs no time beyond it."""

    board: ProgressBoard
    report: Callable[[StallEvent], None]
    floor_s: float = 1.5
    factor: float = 5.0
    recent: list[float] = field(default_factory=list)
    _judged: tuple[str, int, int] | None = None
    _pending: _Pending | None = None

    def step_done(self, seconds: float) -> None:
        self.recent.append(seconds)
        del self.recent[:-32]
        self.board.progress.done += 1

    def median_step_s(self) -> float:
        ordered = sorted(self.recent)
        return ordered[len(ordered) // 2] if ordered else 0.0

    def threshold_s(self) -> float:
        return max(self.floor_s, self.factor * self.median_step_s())

    def stalled(self, epoch: str, step: int, waited_s: float) -> None:
        """Called while this rank waits in step `step` (in a collective or for the
        decision), every few hundred milliseconds."""
        if len(self.recent) < MIN_HISTORY or self.board.progress.done < 1:
            return  # no step time to judge against yet (start, recovery, joining)
        threshold, lead = self.threshold_s(), GAP_BEATS * self.board.interval_s
        if time.monotonic() - self.board.moved_at < threshold + lead:
            # Everyone waited for the store to move, and the board is being refilled.
            self._pending = None
            return
        pending = self._pending
        if pending is not None and pending.key[:2] == (epoch, step):
            due = pending.key[2] * threshold
            if waited_s >= due and time.monotonic() - pending.read_at >= lead:
                self._pending = None
                stall = self.board.examine(
                    epoch,
                    step,
                    pending.first,
                    waited_s,
                    self.median_step_s(),
                    time.monotonic() - pending.read_at,
                )
                if stall is not None:
                    self.report(stall)
            return
        attempt = int((waited_s + lead) // threshold)
        key = (epoch, step, attempt)
        if attempt < 1 or self._judged == key:
            return
        self._judged = key
        self._pending = None
        if self.board.claim(epoch, step, attempt):
            self._pending = _Pending(key, self.board.read(), time.monotonic())
