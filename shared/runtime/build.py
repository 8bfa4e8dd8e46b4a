"""Building groups: claim a slot in the rendezvous store, make the backend, and build a
plan's groups in a background thread (phase 1 of a switch) while training goes on.

Before joining, a rank claims its group rank in the store with compare-and-set under
the prefix of (job, group, generation), so the store is the arbiter: a rank of an old
generation, or any second claimant, can never join. The built `Group` objects are
`trainmover.runtime.groups`'.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainmover.runtime.abort import POLL_S, AbortSignal
from trainmover.runtime.groups import Backend, Group, StaleMemberError
from trainmover.runtime.plan import GroupSpec, RankRef


class BuildAbandoned(RuntimeError):
    """The caller stopped waiting for a build (its plan was superseded); the groups the
    builder finishes are shut down, never installed."""


def pick_device(requested: str, local_rank: int) -> torch.device:
    """cuda:<local_rank> (NCCL groups) when asked or available, else cpu (gloo groups)."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _make_backend(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: timedelta,
    device: torch.device,
    connections: int = 1,
) -> Backend:
    """NCCL on CUDA; else gloo with `connections` devices, each its own connection to
    every peer with its own I/O thread (gloo maps a tag to one of them)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if connections == 1:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    cls: Any = dist.ProcessGroupGloo  # its stubs lack the options class
    gloo = cls._Options()
    gloo._timeout = timeout
    gloo._devices = [_gloo_device(cls, i) for i in range(connections)]
    return cls(store, rank, size, gloo)


def _gloo_device(cls: Any, index: int) -> Any:
    """The `index`th gloo device: on the interfaces GLOO_SOCKET_IFNAME lists, in turn, as
    c10d's own constructor does (its default device is the host name's address, which
    a machine in a network namespace of its own cannot be reached at)."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if not interfaces:
        return cls.create_default_device()
    return cls.create_device(interface=interfaces[index % len(interfaces)])


def build_group(
    spec: GroupSpec,
    me: RankRef,
    store: dist.Store,
    job: str,
    device: torch.device,
    timeout_s: float,
    signal: AbortSignal | None = None,
    transfer_connections: int = 1,
) -> Group:
    """Claims my slot of `spec` in the store, then joins the group (blocks until all
    members arrived); a transfer pair with `transfer_connections` connections. Safe to
    call from a background thread: the backend constructor releases the GIL, so
    training on the main thread keeps going."""
    rank = spec.group_rank(me)
    if rank is None:
        raise ValueError(f"{me} is not a member of {spec.name}")
    prefixed = dist.PrefixStore(spec.store_prefix(job), store)
    owner = prefixed.compare_set(f"claim/{rank}", "", str(me)).decode()
    if owner != str(me):
        raise StaleMemberError(
            f"{spec.name} g{spec.generation} rank {rank} belongs to {owner}, not {me}"
        )
    started = time.perf_counter()
    connections = transfer_connections if spec.kind == "transfer" else 1
    timeout = timedelta(seconds=timeout_s)
    backend = _make_backend(prefixed, rank, len(spec.members), timeout, device, connections)
    return Group(spec, rank, backend, time.perf_counter() - started, signal)


@dataclass
class GroupBuilder:
    """Builds a list of groups in a background thread (phase 1 of the switch).

    The specs are built in the order given, which callers take from
    `Plan.specs_for` (a global order, so no two ranks wait on each other). `connect`
    opens the store client on the build's own thread: while the store fails over it
    blocks until a replica serves, and the caller (holding the rank's lock, that the
    training thread takes at every step) must not wait for that."""

    specs: list[GroupSpec]
    me: RankRef
    connect: Callable[[], dist.Store]
    job: str
    device: torch.device
    timeout_s: float
    signal: AbortSignal | None = None
    transfer_connections: int = 1
    built: list[Group] = field(default_factory=list)
    error: BaseException | None = None
    started: float = 0.0
    elapsed_s: float = 0.0
    _done: threading.Event = field(default_factory=threading.Event)
    _discarded: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, name: str = "group-builder") -> GroupBuilder:
        self.started = time.perf_counter()
        threading.Thread(target=self._run, name=name, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            store: dist.Store | None = None
            for spec in self.specs:
                if store is None:
                    store = self.connect()
                self.built.append(
                    build_group(
                        spec,
                        self.me,
                        store,
                        self.job,
                        self.device,
                        self.timeout_s,
                        self.signal,
                        self.transfer_connections,
                    )
                )
        except BaseException as exc:  # reported to the caller, never swallowed
            self.error = exc
        finally:
            self.elapsed_s = time.perf_counter() - self.started
            with self._lock:
                self._done.set()
                discarded = self._discarded
            if discarded or self.error is not None:  # nobody will install these groups
                self._shutdown_built()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float, abandon: Callable[[], bool] | None = None) -> list[Group]:
        """The built groups; raises the build error, or TimeoutError. With `abandon`,
        checked every POLL_S: once it is true the build is discarded (BuildAbandoned),
        so a rendezvous with a member that will never come does not hold the caller."""
        deadline = time.monotonic() + timeout_s
        while not self._done.wait(POLL_S if abandon is not None else timeout_s):
            if abandon is not None and abandon():
                self.discard()
                raise BuildAbandoned(f"stopped waiting for {[s.name for s in self.specs]}")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"groups {[s.name for s in self.specs]} not built in {timeout_s}s"
                )
        if self.error is not None:
            raise self.error
        return self.built

    def discard(self) -> None:
        """Nobody will install these groups: shut down what is built, now or when the
        build ends (a gloo group alive at exit can abort the process)."""
        with self._lock:
            self._discarded = True
            done = self._done.is_set()
        if done:
            self._shutdown_built()

    @property
    def discarded(self) -> bool:
        return self._discarded

    @property
    def troubled(self) -> bool:
        """Discarded, failed or still running: its rendezvous may have left gloo state
        behind in this process."""
        return self._discarded or self.error is not None or not self.done

    def _shutdown_built(self) -> None:
        built, self.built = self.built, []
        for group in built:
            group.shutdown()
