"""The default (world) group of a TP/PP layout: a real group, built on first use.

Libraries ask for a default group (`DeviceMesh`, `parallelize_module` and
`PipelineStage` call `get_rank()`), and some scripts all-reduce over it. A world group
contains every migration's leaver, so the runtime never builds one eagerly (that would
turn every delta into a full rebuild): `LazyWorld` builds it, over every rank of the
job, at the first collective that needs it, and a switch only drops it.

Who must build again is not something a rank can know alone: a planned migration
reaches only the ranks that share a role group with the leaver, yet every rank's world
group contains it. So the first world collective of each step (of each (vote epoch,
step) slot; later ones in the step reuse the answer) is preceded by a barrier through
the rendezvous store:

    if I hold no world group (never built, or dropped at a switch): set {ns}/rebuild
    add({ns}/arrived, 1); the last arrival sets {ns}/all; everyone waits for {ns}/all
    {ns}/rebuild set  ->  every rank drops its world group and builds "world.<slot>"

A joiner holds none and every switching rank dropped its own, so the first world
collective after a migration (planned or a failure's recovery) rebuilds it on every
rank, those the plan never reached included. The barrier costs a few store round trips
per step that uses the world group, and nothing to a job that never does.

A rank that never makes the collective the others make would leave them waiting: the
barrier gives up after the runtime's `group_timeout_s` with `WorldGroupTimeout`, naming
the step and how many ranks came. Waits are abortable (a failure elsewhere ends them
with `StepAborted`, and the recovery follows), and counted as waiting, not compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import structlog

from trainmover.runtime.abort import POLL_S, AbortSignal, StepAborted
from trainmover.runtime.build import BuildAbandoned, GroupBuilder
from trainmover.runtime.groups import Group, retire
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.steptime import WAITS
from trainmover.runtime.storeclient import Store

#: The name every world incarnation starts with ("world.<epoch>.<step>").
WORLD = "world"


class WorldGroupTimeout(RuntimeError):
    """Not every rank of the job reached a collective on the default group in time."""


def world_spec(me: RankRef, rank: int, size: int, slot: str) -> GroupSpec:
    """One incarnation of the world group. Only this rank's own slot is known (a rank
    does not know which machine plays every other rank); the others are placeholders,
    never claimed by this rank and never blamed for a failure (no machine name)."""
    members = [me if i == rank else RankRef(machine="", local_rank=0) for i in range(size)]
    return GroupSpec(name=f"{WORLD}.{slot}", kind="world", generation=0, members=members)


class LazyWorld:
    """One rank's world group: built at the first collective that needs it, dropped at
    a switch (see the module docstring)."""

    def __init__(
        self,
        me: RankRef,
        job: str,
        rank: int,
        size: int,
        *,
        slot: Callable[[], str],
        store: Callable[[], Store],
        build: Callable[[list[GroupSpec], str], GroupBuilder],
        signal: AbortSignal,
        timeout_s: float,
        log: Callable[[], structlog.stdlib.BoundLogger],
    ):
        self.me, self.job, self.rank, self.size = me, job, rank, size
        #: The (vote epoch, step) slot of the collective being made, as "<epoch>/<step>".
        self._slot = slot
        self._new_store = store
        self._build = build
        self._signal = signal
        self._timeout_s = timeout_s
        self._log = log
        self._store: Store | None = None
        self._waiter: Store | None = None  # the barrier helper's client
        self._group: Group | None = None
        self._checked = ""  # the slot whose barrier this rank passed
        self._lock = threading.Lock()

    @property
    def built(self) -> Group | None:
        """The world group this rank holds (None: never built, or dropped)."""
        return self._group

    def current(self) -> Group:
        """The world group for a collective now; the first call of a slot passes the
        barrier and, when some rank holds none, builds a new one with every rank."""
        with self._lock:
            slot = self._slot()
            if slot != self._checked:
                previous, self._checked = self._checked, slot
                if self._barrier(slot, previous):
                    self._rebuild(slot)
            if self._group is None:  # this slot's build failed: the step is lost
                raise StepAborted(f"{WORLD}: no world group at {slot} (its build failed)")
            return self._group

    def drop(self) -> None:
        """A switch: the group contains the old membership; shut it down, build nothing."""
        with self._lock:
            if self._group is not None:
                self._log().info("world_dropped", group=self._group.name)
                self._retire()

    def close(self) -> None:
        """At exit (a gloo group alive then can abort the process)."""
        with self._lock:
            self._retire()

    def _retire(self) -> None:
        if self._group is not None:
            retire([self._group])
            self._group = None

    # -- the barrier and the build -------------------------------------------------------

    def _key(self, slot: str, what: str) -> str:
        return f"{self.job}/{WORLD}/{slot}/{what}"

    def _barrier(self, slot: str, previous: str) -> bool:
        """Every rank at the slot's first world collective; True when one holds no world
        group (then every rank builds a new one)."""
        if self._store is None:
            self._store = self._new_store()
        store = self._store
        if self._group is None:
            store.set(self._key(slot, "rebuild"), "1")
        started = time.monotonic()
        with WAITS.waiting():
            arrived = store.vote(self._key(slot, "arrived"), self.size, self._key(slot, "all"), "1")
            if arrived == self.size:
                self._forget(store, previous)
            else:
                self._wait_all(store, slot, started)
        if previous:
            store.forget(self._key(previous, ""))
        return store.check([self._key(slot, "rebuild")])

    def _wait_all(self, store: Store, slot: str, started: float) -> None:
        """Until the slot's last arrival. A store wait cannot be interrupted, so a helper
        thread makes it on a client of its own, and this thread waits for the helper or
        the abort signal; an abandoned helper keeps its client until its wait ends."""
        key, left = self._key(slot, "all"), self._timeout_s - (time.monotonic() - started)
        if self._waiter is None:
            self._waiter = self._new_store()
        waiter, done, failed = self._waiter, threading.Event(), []

        def wait() -> None:
            try:
                waiter.wait([key], timedelta(seconds=max(left, POLL_S)))
            except RuntimeError as exc:  # its timeout, or the store went away
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait, name="world-barrier", daemon=True).start()
        while not done.wait(POLL_S):
            if self._signal.is_set():
                self._waiter = None  # still blocked: never used again
                raise StepAborted(f"{WORLD}: step aborted ({self._signal.reason})")
        if failed:
            arrived = store.count(self._key(slot, "arrived"))
            raise WorldGroupTimeout(
                f"a collective on the default (world) group at {slot} (epoch/step): "
                f"{arrived} of {self.size} ranks reached their first world collective "
                f"of the step within group_timeout_s={self._timeout_s:.0f}s. Every rank "
                "of the job must make the same collectives on the default group; for "
                "one that only some ranks make, pass the group of the dimension, "
                "rt.process_group('tp' | 'pp' | 'dp')"
            )

    def _forget(self, store: Store, slot: str) -> None:
        """The last arrival of a slot: every rank has passed the previous one."""
        if slot:
            for what in ("arrived", "all", "rebuild"):
                store.delete_key(self._key(slot, what))

    def _rebuild(self, slot: str) -> None:
        self._retire()
        spec = world_spec(self.me, self.rank, self.size, slot.replace("/", "."))
        builder = self._build([spec], f"build-{spec.name}")
        try:
            built = builder.wait(self._timeout_s, abandon=self._signal.is_set)
        except BuildAbandoned:
            raise StepAborted(f"{spec.name}: step aborted ({self._signal.reason})") from None
        self._group = built[0]
        self._log().info(
            "world_built",
            group=spec.name,
            rank=self.rank,
            size=self.size,
            build_s=round(self._group.build_s, 4),
        )
