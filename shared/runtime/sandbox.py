"""The sandbox of shadow iterations: groups whose collectives never leave the machine.

A standby warms up by running real iterations of a role it does not have yet. Every
collective that would leave the sandbox is answered locally by a `SandboxGroup`:

- a point-to-point receive (pipeline activations and gradients) is *replayed* from a
  recording that a live rank of the same role type made during an early step, when one
  exists with the right shape, or else *synthesised* (a seeded standard normal: finite,
  non-zero, what LayerNorm-ed hidden states look like, so nothing turns into NaN);
- an all-reduce over data-parallel replicas answers "every replica had my values" (the
  sum is `size` times the input), which keeps gradients valid after the average;
- sends complete at once.

Communication inside the sandbox may run for real: the standby machine's own ranks form
their TP group over a `FileStore` in a machine-local directory, so there is no network
path to the live job (no rendezvous store, no address of any live rank).

Recordings live in a pluggable `RecordStore`: a directory here, or the job's NATS object
store (`trainmover.runtime.records`). Only one rank per role type records (replica 0,
TP rank 0, the first stage of its type): pipeline tensors are replicated across TP, so
the other roles would store duplicates.
"""

from __future__ import annotations

import io
import os
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch
import torch.distributed as dist

from trainmover.runtime import pipelines
from trainmover.runtime.c10d import completed_work
from trainmover.runtime.groups import C10dWork, Group, GroupTable
from trainmover.runtime.layout import GroupKind, Layout, Role
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.steptime import InFlightSpan


class RecordStore(Protocol):
    """Where recorded collective outputs live, by key (one per role type)."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def size_bytes(self) -> int: ...

    def close(self) -> None: ...


class DirectoryRecordStore:
    """Records as files of a directory (shared storage, or copied to the standby)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def put(self, key: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        tmp.replace(self.root / key)  # atomic: a reader sees all or nothing

    def get(self, key: str) -> bytes | None:
        path = self.root / key
        return path.read_bytes() if path.exists() else None

    def size_bytes(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.root.iterdir() if not p.name.startswith("."))

    def close(self) -> None:
        return None


def record_key(role_type: str) -> str:
    return f"{role_type}.pp-recv.pt"


class Recorder:
    """Taps a live rank's pipeline group during one step and stores what it received,
    and the shapes its pipeline stages settled on (`trainmover.runtime.pipelines`)."""

    def __init__(self) -> None:
        self.received: dict[int, torch.Tensor] = {}

    def tap(self, tag: int, tensor: torch.Tensor) -> None:
        self.received[tag] = tensor.detach().cpu().clone()

    def save(self, store: RecordStore, role_type: str) -> int:
        buf = io.BytesIO()
        torch.save(self.received, buf)
        shapes = pipelines.describe().encode()
        if shapes:
            store.put(shapes_key(role_type), shapes)
        # Last: a standby waiting for the recording (`await_record`) finds it whole.
        store.put(record_key(role_type), buf.getvalue())
        return buf.getbuffer().nbytes + len(shapes)


class LiveRecording:
    """A live rank's part in what standbys replay: one rank per role type (replica 0, TP
    rank 0, the first stage of its type) taps its pipeline group during `record_step`,
    and saves what it received once that step committed."""

    def __init__(self, layout: Layout, record_step: int, store: RecordStore) -> None:
        self._layout, self._record_step, self._store = layout, record_step, store
        self._recorder: Recorder | None = None

    def begin(self, step: int, role: Role | None, groups: GroupTable) -> None:
        lay = self._layout
        if step != self._record_step or role is None or lay.pp == 1:
            return
        if role == lay.role_of_type(lay.role_type(role.pp), 0):
            self._recorder = Recorder()
            groups["pp"].tap = self._recorder.tap

    def end(
        self,
        committed: int | None,
        role: Role | None,
        groups: GroupTable,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        """The step ended, committed (`committed`: its number) or discarded (None)."""
        if self._recorder is None:
            return
        recorder, self._recorder = self._recorder, None
        groups["pp"].tap = None
        if committed is not None and role is not None:
            role_type = self._layout.role_type(role.pp)
            try:
                size = recorder.save(self._store, role_type)
            except Exception:  # standbys then synthesise; training must not stop for it
                log.exception("record_failed", role_type=role_type, step=committed)
                return
            log.info("recorded", role_type=role_type, bytes=size, step=committed)


def await_record(store: RecordStore, role_type: str, timeout_s: float) -> bool:
    """Waits until a live rank of `role_type` has saved its recording (a standby that
    starts with the job warms up before the job's `record_step` is over); False after
    `timeout_s`. A store has no change notification to wait on: it is polled, ever
    less often, up to once a second."""
    deadline = time.monotonic() + timeout_s
    pause = 0.05
    while store.get(record_key(role_type)) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 1.0)
    return True


def load_record(store: RecordStore, role_type: str) -> dict[int, torch.Tensor]:
    data = store.get(record_key(role_type))
    if data is None:
        return {}
    return torch.load(io.BytesIO(data), weights_only=True)


def shapes_key(role_type: str) -> str:
    """Where a live rank's pipeline stage shapes are recorded (`pipelines.describe`)."""
    return f"{role_type}.pp-shapes.json"


def load_shapes(store: RecordStore, role_type: str) -> str:
    data = store.get(shapes_key(role_type))
    return data.decode() if data else ""


class _Done:
    """A work item that is already complete (a sandboxed send)."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class SandboxStats:
    def __init__(self) -> None:
        self.replayed = self.synthesized = self.local = 0


class LocalBackend:
    """The c10d face of a sandboxed group (what `trainmover.runtime.c10d` forwards to):
    every collective is answered at once, as if every other member held this rank's
    values, so DDP's start-up checks pass and its averaged gradients stay this rank's."""

    def __init__(
        self,
        rank: int,
        size: int,
        stats: SandboxStats,
        gen: torch.Generator,
        record: dict[int, torch.Tensor] | None = None,
    ):
        self.rank, self.size, self._stats, self._gen = rank, size, stats, gen
        self._record = record or {}

    def _done(self, tensors: Any = None) -> Any:
        self._stats.synthesized += 1
        return completed_work(tensors)

    def _reduce(self, tensor: torch.Tensor, opts: Any) -> None:
        if getattr(opts, "reduceOp", dist.ReduceOp.SUM) == dist.ReduceOp.SUM:
            tensor.mul_(self.size)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        for t in tensors:
            self._reduce(t, opts)
        return self._done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return self._done()

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        for out, inp in zip(outputs, inputs, strict=True):
            for t in out:
                t.copy_(inp)
        return self._done(outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        output.copy_(input.reshape(1, -1).expand(self.size, -1).reshape(output.shape))
        return self._done([output])

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> Any:
        for out, inp in zip(outputs, inputs, strict=True):
            out.copy_(inp[self.rank])
            self._reduce(out, opts)
        return self._done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        output.copy_(input.reshape(self.size, -1)[self.rank].reshape(output.shape))
        self._reduce(output, opts)
        return self._done([output])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any) -> Any:
        output.copy_(input)
        return self._done([output])

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        return completed_work()  # completes at once; nothing is synthesised

    def receive(self, tensor: torch.Tensor, tag: int) -> None:
        """A receive, replayed from the recording when it has the tag with this shape,
        else synthesised (seeded standard normal). An integer receive is a pipeline
        schedule's warm-up vote: ones, "every stage knows its shapes"
        (`trainmover.runtime.pipelines`)."""
        recorded = self._record.get(tag)
        with torch.no_grad():  # a pipeline's receive buffer may require grad, as in c10d
            if not tensor.is_floating_point():
                self._stats.synthesized += 1
                tensor.fill_(1)
            elif recorded is not None and recorded.shape == tensor.shape:
                self._stats.replayed += 1
                tensor.copy_(recorded)
            else:
                self._stats.synthesized += 1
                tensor.copy_(torch.randn(tensor.shape, generator=self._gen))

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        for t in tensors:
            self.receive(t, tag)
        return completed_work()  # holding no tensor: nothing of a shadow outlives it


class SandboxGroup(Group):
    """A PP, DP or world group of the role being warmed, answered locally."""

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        record: dict[int, torch.Tensor],
        stats: SandboxStats,
        seed: int,
    ):
        self._gen = torch.Generator().manual_seed(seed)
        self._local = LocalBackend(rank, len(spec.members), stats, self._gen, record)
        super().__init__(spec, rank, backend=self._local, build_s=0.0)
        self._stats = stats

    def allreduce(self, tensor: torch.Tensor) -> None:
        # As if every replica held our values: the average is then our own gradient.
        self._stats.synthesized += 1
        tensor.mul_(self.size)

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Any:
        return _Done()

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        self._local.receive(tensor, tag)

    def barrier(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


class LocalGroup(Group):
    """A real group of the standby machine's own ranks (its TP group), counted."""

    def __init__(self, inner: Group, stats: SandboxStats):
        super().__init__(inner.spec, inner.rank, inner.backend, inner.build_s)
        self._stats = stats

    def allreduce(self, tensor: torch.Tensor) -> None:
        self._stats.local += 1
        super().allreduce(tensor)

    def track(self, call: str, start: Callable[[], Any]) -> tuple[C10dWork, InFlightSpan]:
        """A collective of the c10d face (`trainmover.runtime.c10d`), counted too."""
        self._stats.local += 1
        return super().track(call, start)


def sandbox_specs(machine: str, layout: Layout, round_id: str) -> dict[str, GroupSpec]:
    """Group specs of a sandbox, by kind: the machine's real TP group, and a group of
    every other kind of the layout's roles (and the world group) of the layout's sizes,
    whose other members are placeholders. Names carry the round, so a store file is
    never reused."""
    me = [RankRef(machine=machine, local_rank=t) for t in range(layout.tp)]
    role = Role(dp=0, pp=0, tp=0)
    kinds: list[GroupKind] = [k for k in layout.role_group_kinds if k != "tp"]
    sizes: dict[str, int] = {k: layout.rank_and_size(k, role)[1] for k in [*kinds, "world"]}

    def spec(kind: str, members: list[RankRef]) -> GroupSpec:
        return GroupSpec(
            name=f"sandbox.{round_id}.{kind}",
            kind=kind,  # type: ignore[arg-type]
            generation=0,
            members=members,
        )

    placeholders = {
        kind: spec(kind, [RankRef(machine="sandbox", local_rank=i) for i in range(size)])
        for kind, size in sizes.items()
    }
    return {"tp": spec("tp", me), **placeholders}


def local_tp_group(spec: GroupSpec, me: RankRef, store_dir: Path, timeout_s: float) -> Group:
    """The machine's TP group over a FileStore: the only real communication of the
    sandbox, and it stays on the machine."""
    store_dir.mkdir(parents=True, exist_ok=True)
    store = dist.FileStore(str(store_dir / f"{spec.name}.store"), len(spec.members))
    rank = spec.group_rank(me)
    assert rank is not None
    backend = dist.ProcessGroupGloo(store, rank, len(spec.members), timedelta(seconds=timeout_s))
    return Group(spec, rank, backend, 0.0)


def seed_for(role_type: str, local_rank: int) -> int:
    return zlib.crc32(f"{role_type}/{local_rank}".encode())
