"""Reconfigurable communication groups: build one from the rendezvous store, keep a table.

There is no global default group (its loss would take every group down): each group is
its own backend object (gloo on CPU, NCCL on CUDA) built from a prefix of the rendezvous
store namespaced by (job, group, generation). Before joining, a rank claims its group rank
in the store with compare-and-set, so the store (hosted off the training machines) is the
arbiter: a rank of an old generation, or any second claimant, can never join.

Building one (the store claim, the backend, background builds) is
`trainmover.runtime.build`.

A rank's `GroupTable` maps each group kind (tp, pp, dp) to its current `Group`. Swapping
replaces only the named kinds; every other entry stays the very same object.

Every wait on a work item goes through the rank's `AbortSignal` (bounded, abortable),
and a group remembers whether a work of it was abandoned or failed (`dirty`): such a
group is out of step with its peers and a recovery rebuilds it.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainmover.runtime import fault
from trainmover.runtime.abort import WAITER, AbortSignal, CollectiveError, StepAborted
from trainmover.runtime.plan import GroupSpec
from trainmover.runtime.steptime import IN_FLIGHT, WAITS, InFlightSpan, future_of

_incarnations = itertools.count(1)

#: A ProcessGroupGloo or ProcessGroupNCCL, used directly (no default group, no dist.*
#: wrappers). Any: their type stubs lack send/recv/barrier, and NCCL's class does not
#: exist in CPU builds.
Backend = Any


class StaleMemberError(RuntimeError):
    """A rank tried to join a group slot that the store says belongs to someone else."""


#: `PendingWork`'s default: the work's future is not known yet.
_LOOK_UP = object()


class PendingWork:
    """A posted work item of a group, waited through the rank's abort signal.

    A collective's work is waited in slices; a point-to-point work is handed to the
    `Waiter` at once (its own timed wait would close the gloo pair), and so is a work
    without a future (gloo's reduce-scatters: their timed wait blocks for the group's
    whole timeout, out of the abort signal's reach)."""

    def __init__(
        self, group: Group, work: Any, peer: int | None, p2p: bool, own_future: Any = _LOOK_UP
    ):
        """`own_future`: the work's own future where the caller has looked it up."""
        self.group, self.work, self.peer = group, work, peer
        if not p2p and own_future is _LOOK_UP:
            own_future = future_of(work)
        self.future = WAITER.submit(work) if p2p or own_future is None else None
        self.failed = False

    @property
    def done(self) -> bool:
        """Finished successfully (an abandoned or failed work is not)."""
        if self.failed:
            return False
        if self.future is not None:
            return self.future.done() and self.future.exception() is None
        return bool(self.work.is_completed())

    def wait(self) -> None:
        self.group._wait(self)


@dataclass(eq=False)
class C10dWork:
    """A c10d work posted for a library, with its future looked up once (each lookup
    makes a new future object; gloo's reduce-scatters have none and say so by raising)."""

    work: Any
    future: Any
    #: The runtime waited it to success (`Group.wait_c10d`).
    waited: bool = False

    @property
    def finished(self) -> bool:
        """Over once waited, or once its future is: gloo completes the future (waking
        the waiter, e.g. DDP's reducer raising in the training thread) before it marks
        the work itself completed, so `is_completed()` can still be False when the
        waiter looks. A work without a future is over once completed, or waited: gloo's
        reduce-scatter never says it completed, even after its wait."""
        if self.waited:
            return True
        return bool(self.future.done() if self.future is not None else self.work.is_completed())

    def error(self) -> Exception | None:
        """The error a finished work ended with, if any."""
        if self.future is None:
            return self.work.exception()  # type: ignore[no-any-return]
        try:
            self.future.value()
        except Exception as exc:  # the work's own error, whatever the backend raised
            return exc
        return None


class Group:
    """One built incarnation of a group, with the collectives the runtime uses.

    Every call waits for its work item; `send` and `irecv` return a `PendingWork`
    instead so a pipeline or a stream can post them and wait for them later.
    """

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        backend: Backend,
        build_s: float,
        signal: AbortSignal | None = None,
    ):
        self.spec = spec
        self.rank = rank
        self.size = len(spec.members)
        self.backend = backend
        self.build_s = build_s
        self.signal = signal or AbortSignal()
        #: Unique per process for the life of the process (unlike id()), so a snapshot
        #: can prove that a group object was not replaced.
        self.incarnation = next(_incarnations)
        self._closed = False
        #: Works posted and not yet waited to success; a failed one taints the group.
        self._inflight: list[PendingWork] = []
        self._failed = False
        #: Works posted for a c10d `SwappableGroup` (waited by their caller, e.g. DDP's
        #: reducer); kept until seen complete.
        self._c10d: list[C10dWork] = []
        #: Sees every tensor received (tag, tensor): how a live rank records for shadow
        #: iterations (`trainmover.runtime.sandbox.Recorder`).
        self.tap: Callable[[int, torch.Tensor], None] | None = None
        self._on: dict[int | None, tuple[str, ...]] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def dirty(self) -> bool:
        """A work of this incarnation failed or was abandoned unfinished: its peers'
        sequence of operations no longer matches ours, so it must not be used again."""
        self._reap_c10d()
        return (
            self._failed
            or any(not w.done for w in self._inflight)
            or any(not w.finished for w in self._c10d)
        )

    def peer_machine(self, peer: int | None) -> str | None:
        """The machine to blame when a work fails: the named peer, or the only other
        member; unknown in a larger collective."""
        if peer is None and self.size == 2:
            peer = 1 - self.rank
        # A world group knows no other member's machine (`trainmover.runtime.world`).
        return None if peer is None else self.spec.members[peer].machine or None

    def _start(self, start: Callable[[], Any], peer: int | None, call: str = "") -> Any:
        """Starts a work item; posting itself fails at once on a closed connection."""
        if self.signal.is_set():
            raise StepAborted(f"{self.name}: step aborted ({self.signal.reason})")
        try:
            return start()
        except RuntimeError as exc:
            self._failed = True
            text = f"{call}: {exc}" if call else str(exc)
            error = CollectiveError(self.name, self.peer_machine(peer), text.strip()[:500])
            self.signal.fail(error)
            raise error from None

    def _post(
        self, start: Callable[[], Any], peer: int | None, p2p: bool = False, call: str = ""
    ) -> PendingWork:
        """Starts a work item that the runtime waits itself (`_wait`)."""
        pending = PendingWork(self, self._start(start, peer, call), peer, p2p)
        self._inflight.append(pending)
        return pending

    def track(self, call: str, start: Callable[[], Any]) -> tuple[C10dWork, InFlightSpan]:
        """Posts a collective of the c10d wrapper (`trainmover.runtime.c10d`) and returns
        its work unwaited, with its in-flight span (timed as waiting unless the runtime
        waits it itself: `wait_c10d`). The work is remembered until finished, so a
        failure or an abandoned work taints this group as the runtime's own collectives
        do."""
        self.c10d_failure()
        work = self._start(start, None, call)
        posted = C10dWork(work, future_of(work))
        self._c10d.append(posted)
        return posted, IN_FLIGHT.track(posted.future)

    def wait_c10d(self, posted: C10dWork, span: InFlightSpan) -> None:
        """A c10d collective's `wait()` (`trainmover.runtime.c10d.RuntimeWork`): through
        the abort signal, in slices, as the runtime's own waits, so a rank blocked on a
        peer that will never post gets out when the epoch is aborted. Timed as waiting
        here, so not by its in-flight span too."""
        span.dropped = True
        pending = PendingWork(self, posted.work, None, p2p=False, own_future=posted.future)
        self._inflight.append(pending)
        self._wait(pending)
        posted.waited = True

    def post_p2p(self, call: str, start: Callable[[], Any], peer: int) -> PendingWork:
        """Posts a c10d send or recv: waited by the `Waiter` (a p2p work has no future on
        gloo, and its own timed wait would close the pair), and tracked as the runtime's
        own sends and receives are."""
        self.c10d_failure()
        return self._post(start, peer, p2p=True, call=call)

    def _reap_c10d(self) -> str | None:
        """Drops the c10d works seen complete; the first error among them, if any (the
        group is then dirty)."""
        error = None
        for work in [w for w in self._c10d if w.finished]:
            self._c10d.remove(work)
            exc = work.error()
            if exc is not None:
                self._failed = True
                error = error or str(exc)[:500]
        return error

    def c10d_failure(self) -> CollectiveError | None:
        """A c10d work of this group that completed with an error since the last call,
        reported through the abort signal (how a step that DDP's reducer failed in is
        recognised as aborted, not as a bug of the training loop)."""
        error = self._reap_c10d()
        if error is None:
            return None
        failure = CollectiveError(self.name, self.peer_machine(None), error)
        self.signal.fail(failure)
        return failure

    def _waits_on(self, peer: int | None) -> tuple[str, ...]:
        """The ranks a wait on `peer` (None: the whole group) waits on, for the
        progress board; made once per peer, as every collective's wait asks."""
        on = self._on.get(peer)
        if on is None:
            members = self.spec.members
            others = [members[peer]] if peer is not None else members
            on = self._on[peer] = tuple(str(m) for m in others if m != members[self.rank])
        return on

    def _wait(self, pending: PendingWork) -> None:
        peer = self.peer_machine(pending.peer)
        # Waiting is not computing: the step's compute time leaves it out.
        try:
            with WAITS.waiting(on=self._waits_on(pending.peer)):
                if pending.future is not None:
                    self.signal.wait_future(pending.future, self.name, peer)
                else:
                    self.signal.wait_work(pending.work, self.name, peer)
        except CollectiveError:
            pending.failed = self._failed = True
            raise
        self._inflight.remove(pending)

    def allreduce(self, tensor: torch.Tensor) -> None:
        """In-place sum over the group."""
        if self.size > 1:
            pending = self._post(lambda: self.backend.allreduce([tensor]), None)
            if self.spec.kind == "dp":
                fault.point("dp-allreduce")  # test-only: a machine dies mid all-reduce
            self._wait(pending)

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> PendingWork:
        return self._post(lambda: self.backend.send([tensor], peer, tag), peer, p2p=True)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        self._wait(self._post(lambda: self.backend.recv([tensor], peer, tag), peer, p2p=True))
        if self.tap is not None:
            self.tap(tag, tensor)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> PendingWork:
        """A receive waited later (a stream of chunks); `tap` does not see it."""
        return self._post(lambda: self.backend.recv([tensor], peer, tag), peer, p2p=True)

    def barrier(self) -> None:
        self._wait(self._post(lambda: self.backend.barrier(), None))

    def shutdown(self) -> None:
        """Releases the backend. Explicit, because a gloo group still alive at interpreter
        exit sometimes aborts the process."""
        if not self._closed:
            self._closed = True
            try:
                self.backend.shutdown()
            except RuntimeError:
                pass  # already broken; nothing left to release

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "generation": self.generation,
            "repair": self.spec.repair,
            "incarnation": self.incarnation,
            "rank": self.rank,
            "size": self.size,
        }


class _Reaper:
    """Drops retired groups on a daemon thread of its own. Destroying a gloo group joins
    its threads (~10 ms per group here, several times that on loaded cores); done where
    the last reference goes, at a step boundary, that would be downtime."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Group]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, groups: list[Group]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="group-reaper", daemon=True)
                self._thread.start()
        self._queue.put(groups)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            batch.clear()  # the last references: the backends are destroyed here


_REAPER = _Reaper()


def retire(groups: list[Group]) -> None:
    """Shuts `groups` down now and destroys them in the background. Takes the list's
    contents (it is left empty): the caller must hold no other reference to them."""
    for group in groups:
        group.shutdown()
    batch = groups[:]
    groups.clear()
    _REAPER.put(batch)


class GroupTable:
    """A rank's current groups, by kind. The model looks groups up here at call time, so
    a swap at a step boundary is seen by the next step."""

    def __init__(self) -> None:
        self._groups: dict[str, Group] = {}

    def __getitem__(self, kind: str) -> Group:
        return self._groups[kind]

    def get(self, kind: str) -> Group | None:
        return self._groups.get(kind)

    def install(self, groups: list[Group]) -> list[Group]:
        """Puts `groups` in place (by kind) and returns the entries they replaced, which
        the caller shuts down. Kinds not in `groups` keep their objects untouched."""
        replaced = []
        for group in groups:
            old = self._groups.get(group.spec.kind)
            # A repair (same generation, new prefix) replaces a dirty incarnation.
            repair = (
                old is not None
                and old.generation == group.generation
                and group.spec.repair not in ("", old.spec.repair)
            )
            if old is not None and old.generation >= group.generation and not repair:
                raise StaleMemberError(
                    f"{group.name}: generation {group.generation} is not newer than "
                    f"{old.generation}"
                )
            if old is not None:
                replaced.append(old)
            self._groups[group.spec.kind] = group
        return replaced

    def shutdown(self) -> None:
        for group in self._groups.values():
            group.shutdown()
        self._groups.clear()

    def values(self) -> list[Group]:
        return list(self._groups.values())

    def snapshot(self) -> dict[str, dict[str, object]]:
        """kind -> name, generation, incarnation: what tests compare across a migration."""
        return {kind: g.describe() for kind, g in sorted(self._groups.items())}
