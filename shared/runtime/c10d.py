# The stubs of c10d's C++ ProcessGroup describe its own bindings, not a Python subclass
# that overrides them (the pybind trampoline calls these methods by name).
# mypy: disable-error-code="override, assignment"
"""Reconfigurable c10d process groups: one stable `torch.distributed.ProcessGroup` per group.

Standard PyTorch code (DDP, DeviceMesh, functional collectives, PipelineStage) holds on
to a `ProcessGroup` object, so the runtime hands out a `SwappableGroup` per group kind
(tp, pp, dp) that lives as long as the job: a Python subclass of the c10d class, built
with the rank and size of its group so that the C++ side sees them, registered by name
(`_register_pg_in_world`) so that `_resolve_process_group(name)` finds it. Each
collective is forwarded to the backend of the runtime's current `Group` of that kind
(gloo on CPU, NCCL on CUDA); a migration installs a new-generation `Group`, and the same
object forwards to it from the next call on. Groups outside the delta are never touched.

Rules the forwarding follows (torch 2.13): `getBackendName` is not "gloo" (DDP would
look for a gloo backend on the wrapper), the wrapper answers its own name, methods take
keyword arguments (`dist.barrier` passes `opts=`), and both names of the renamed
collectives are defined. A collective the runtime's groups do not support raises
`UnsupportedCollective` at once, naming the call and the fix, instead of hanging.

Every work posted is tracked by its `Group` (`Group.track`, `Group.post_p2p`), so a
failed or abandoned collective marks the group dirty and is reported through the rank's
abort signal, as for the runtime's own collectives. The works handed out are
`RuntimeWork`s: their `wait()` (what `dist.*` calls, functional collectives'
`wait_tensor` and DDP's start-up checks make) goes through the rank's abort signal in
slices, so a rank blocked on a peer that will never post gets out once the epoch is
aborted, and so does a library waiting on a work's future in C++ (DDP's reducer); a
send or receive is waited by the `Waiter` (gloo gives a p2p work no future, and its own
timed wait would close the pair), and a receive is seen by the group's recording tap
once complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C import _distributed_c10d as _c10d
from torch.distributed.distributed_c10d import GroupName

from trainmover.runtime import fault
from trainmover.runtime.groups import C10dWork, Group, PendingWork
from trainmover.runtime.steptime import InFlightSpan

#: What `getBackendName` answers (never "gloo": see the module docstring).
BACKEND_NAME = "trainmover"


class UnsupportedCollective(RuntimeError):
    """A collective the reconfigurable groups do not forward."""


class GroupNotReady(RuntimeError):
    """A collective on a group whose runtime group is not installed yet."""


def completed_work(value: Any = None) -> dist.Work:
    """A work item that is already done (a collective answered locally)."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return _c10d._create_work_from_future(fut)  # type: ignore[attr-defined]


class _Discarding(threading.local):
    active = False


_DISCARDING = _Discarding()


@contextmanager
def discarding() -> Iterator[None]:
    """While a library cleans up after a discarded step (FSDP2's `reset_iter_state`),
    this thread's waits on unfinished works return at once instead of waiting through
    the abort signal: the works are abandoned, and their groups repaired by the
    recovery."""
    _DISCARDING.active = True
    try:
        yield
    finally:
        _DISCARDING.active = False


class RuntimeWork(dist.Work):
    """A c10d work of a `SwappableGroup`, waited through its group (see the module
    docstring): a collective's work (`pending` None), or a send or receive."""

    def __init__(
        self,
        group: Group,
        work: Any,
        span: InFlightSpan | None = None,
        pending: PendingWork | None = None,
        received: tuple[int, torch.Tensor] | None = None,
        posted: C10dWork | None = None,
    ):
        super().__init__()
        self._group, self._work, self._span, self._pending = group, work, span, pending
        self._posted = posted  # a collective's record, with its own future if any
        self._received = received  # (tag, tensor) of a receive, for the group's tap
        self._waited = False

    def wait(self, timeout: Any = None) -> bool:
        if self._waited:
            return True
        if _DISCARDING.active and not self.is_completed():
            return False  # a discarded step's work: abandoned (its group stays dirty)
        if self._pending is None:
            assert self._span is not None and self._posted is not None
            self._group.wait_c10d(self._posted, self._span)
        else:
            self._group._wait(self._pending)
        self._waited = True
        if self._received is not None and self._group.tap is not None:
            self._group.tap(*self._received)
        return True

    def is_completed(self) -> bool:
        if self._pending is not None:
            return self._pending.done
        return self._posted is not None and self._posted.finished

    def is_success(self) -> bool:
        return self.is_completed()

    def get_future(self) -> Any:
        if self._pending is not None:
            raise UnsupportedCollective("a send or receive has no future: wait() it")
        # Without one of its own, the work's lookup raises what the backend says.
        own = self._posted.future if self._posted is not None else None
        future = own if own is not None else self._work.get_future()
        if isinstance(self._group.backend, dist.ProcessGroupGloo):
            return self._group.signal.guard(future)
        return future

    def exception(self) -> Any:
        return None if self._pending is not None else self._work.exception()


def _each(
    collective: Callable[[torch.Tensor, torch.Tensor, Any], Any],
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    opts: Any,
) -> Any:
    """A coalesced collective as one collective per pair (gloo has no coalesced variant);
    the last work stands for all, since works of one group complete in order."""
    work = None
    for output, input in zip(outputs, inputs, strict=True):
        work = collective(output, input, opts)
    return work if work is not None else completed_work()


class SwappableGroup(dist.ProcessGroup):
    """A c10d ProcessGroup whose collectives go to the runtime's current group of one kind.

    `current` returns that group (it changes at a switch); rank and size are fixed for
    the job's life, because a joiner takes exactly its leaver's group rank."""

    def __init__(self, name: str, rank: int, size: int, current: Callable[[], Group | None]):
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._name = name
        self._current = current
        self._set_group_name(GroupName(name))

    # -- identity -----------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._name

    def getGroupName(self) -> str:  # noqa: N802 - c10d's name
        return self._name

    def name(self) -> str:
        return BACKEND_NAME

    # -- forwarding ---------------------------------------------------------------------

    def _group(self, call: str) -> Group:
        group = self._current()
        if group is None:
            raise GroupNotReady(
                f"{call} on process group {self._name!r} before the runtime installed it: "
                "run collectives inside `for step in rt.steps()` (or the shadow step)"
            )
        return group

    def _post(self, call: str, start: Callable[[Any], Any]) -> Any:
        group = self._group(call)
        posted, span = group.track(call, lambda: start(group.backend))
        if group.spec.kind in ("dp", "dp_shard", "dp_replicate"):
            # test-only: a machine dies mid gradient reduction (DDP, HSDP; FSDP2)
            if call == "allreduce":
                fault.point("dp-allreduce")
            elif call == "reduce_scatter_single":
                fault.point("dp-reduce-scatter")
        return RuntimeWork(group, posted.work, span, posted=posted)

    def _p2p(self, call: str, start: Callable[[Any], Any], peer: int, received: Any = None) -> Any:
        group = self._group(call)
        pending = group.post_p2p(call, lambda: start(group.backend), peer)
        if call == "recv":
            fault.point("pp-recv")  # test-only: a machine dies mid pipeline exchange
        return RuntimeWork(group, pending.work, pending=pending, received=received)

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._post("allreduce", lambda b: b.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._post("allreduce_coalesced", lambda b: b.allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._post("broadcast", lambda b: b.broadcast(tensors, opts))

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        return self._post("allgather", lambda b: b.allgather(output_tensors, input_tensors, opts))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        return self._post("all_gather_single", lambda b: b._allgather_base(output, input, opts))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _each(self._allgather_base, outputs, inputs, opts)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._post(
            "reduce_scatter", lambda b: b.reduce_scatter(output_tensors, input_tensors, opts)
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._post(
            "reduce_scatter_single", lambda b: b._reduce_scatter_base(output, input, opts)
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _each(self._reduce_scatter_base, outputs, inputs, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._post(
            "all_to_all_single",
            lambda b: b.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
        )

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._post("alltoall", lambda b: b.alltoall(output_tensors, input_tensors, opts))

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._post("reduce", lambda b: b.reduce(tensors, opts))

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.GatherOptions()
        return self._post("gather", lambda b: b.gather(output_tensors, input_tensors, opts))

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._post("scatter", lambda b: b.scatter(output_tensors, input_tensors, opts))

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._post("barrier", lambda b: b.barrier(opts))

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:  # noqa: N803
        return self._p2p("send", lambda b: b.send(tensors, dstRank, tag), dstRank)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:  # noqa: N803
        received = (tag, tensors[0]) if len(tensors) == 1 else None
        return self._p2p("recv", lambda b: b.recv(tensors, srcRank, tag), srcRank, received)

    # -- refused ------------------------------------------------------------------------

    def _unsupported(self, call: str, fix: str) -> UnsupportedCollective:
        return UnsupportedCollective(
            f"{call} on process group {self._name!r}: not supported by TrainMover's "
            f"reconfigurable groups; {fix}"
        )

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("recv_anysource", "receive from an explicit source rank")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("monitored_barrier", "use dist.barrier")

    def split_group(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported(
            "split_group", "take each dimension's group from the runtime (rt.process_group)"
        )

    def merge_remote_group(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("merge_remote_group", "groups come from the job config's layout")


def register(pg: SwappableGroup, global_ranks: list[int], store: dist.Store) -> None:
    """Makes `pg` findable by name (functional collectives, DeviceMesh) with its global
    ranks; `global_ranks[i]` is group rank i's rank in the default group."""
    c10d._register_pg_in_world(
        pg,
        BACKEND_NAME,
        store,
        GroupName(pg.group_name),
        BACKEND_NAME,
        rank_mapping={g: i for i, g in enumerate(global_ranks)},
    )


def unregister(pg: SwappableGroup) -> None:
    """Forgets `pg` (a sandbox's groups, when its shadow round ends)."""
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config):
        table.pop(pg, None)
    for tag, pgs in list(world.tags_to_pg.items()):
        world.tags_to_pg[tag] = [p for p in pgs if p is not pg]
    world.pg_to_tag.pop(pg, None)
    c10d._unregister_process_group(GroupName(pg.group_name))
