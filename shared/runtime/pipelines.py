"""`torch.distributed.pipelining` schedules under the runtime: every schedule a rank
builds is known, so that all members of a changed pipeline redo its first-step handshake
together, and only they.

A schedule's first step runs a handshake with the neighbour stages (an int32 vote on
whether every stage knows its shapes; where one does not, the shapes are inferred by
running the stage's forward and backward once) and remembers that it did. A joiner's
schedule is fresh and its stayers' are not, so the joiner would wait for a vote nobody
sends. Every member of a changed pipeline therefore *restarts* its schedules (forgets
the handshake and the losses of an unfinished step) at the boundary they cross together:

- a switch that installed a new pipeline group restarts them *pinned*: a stayer's stages
  keep the shapes they settled on, the joiner's take the leaver's (`describe`, sent with
  the state), so the handshake is the vote alone. An inference forward would run FSDP's
  all-gathers over data-parallel groups shared with pipelines that did not restart;
- a recovery (every rank of the job, a step in flight discarded everywhere) restarts
  every schedule with the user's own shapes, as at the job's start.

Inside the sandbox a standby's stage has no neighbours. Its vote is answered "every stage
knows its shapes" (`trainmover.runtime.sandbox` answers integer receives with ones), so
a stage built without shapes borrows, for the shadow only, the shapes that a live rank of
the same role type recorded (`lending`). The shadow's schedule dies with the shadow.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _StageMeta, _TensorMeta
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _PipelineSchedule,
)

#: The flags by which a schedule remembers its first-step handshake (single-stage and
#: multi-stage schedules name them differently).
_INITIALIZED = (
    "_stage_forward_initialized",
    "_stage_backward_initialized",
    "_stages_forward_initialized",
    "_stages_backward_initialized",
)

#: The two classes whose constructors set a schedule's stages (every schedule is one).
_CLASSES: tuple[type[_PipelineSchedule], ...] = (PipelineScheduleSingle, PipelineScheduleMulti)
_REAL_INITS = {cls: cls.__init__ for cls in _CLASSES}
_SCHEDULES: weakref.WeakSet[_PipelineSchedule] = weakref.WeakSet()
#: The user's own shapes of each stage whose shapes the runtime pinned.
_OWN: weakref.WeakKeyDictionary[PipelineStage, _StageMeta] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
#: Shapes lent to the stages of schedules built now (a shadow), by position.
_LENT: list[dict[str, Any]] | None = None


def _registering(cls: type[_PipelineSchedule]) -> Any:
    real = _REAL_INITS[cls]

    def init(self: _PipelineSchedule, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        with _LOCK:
            _SCHEDULES.add(self)
            lent = _LENT
        if lent is not None:
            _pin(stages_of(self), lent)

    return init


def install() -> None:
    """Every pipeline schedule built from now on is known to the runtime."""
    for cls in _CLASSES:
        cls.__init__ = _registering(cls)  # type: ignore[method-assign]


def remove() -> None:
    for cls, real in _REAL_INITS.items():
        cls.__init__ = real  # type: ignore[method-assign]
    with _LOCK:
        _SCHEDULES.clear()


def schedules() -> list[_PipelineSchedule]:
    with _LOCK:
        return list(_SCHEDULES)


def stages_of(schedule: _PipelineSchedule) -> list[Any]:
    """The stages this rank runs in `schedule`, in order."""
    single = getattr(schedule, "_stage", None)
    return [single] if single is not None else list(getattr(schedule, "_stages", []))


def restart(pinned: bool, lent: str = "") -> int:
    """Every known schedule redoes its first-step handshake at its next step, and drops
    the losses of a step that did not finish; how many schedules were restarted.
    `pinned`: each stage keeps the shapes it settled on, or (a joiner's, which settled on
    none) takes `lent` (`describe`'s JSON); else every stage gets the user's own back."""
    known = schedules()
    for schedule in known:
        for flag in _INITIALIZED:
            if hasattr(schedule, flag):
                setattr(schedule, flag, False)
        schedule._internal_losses.clear()
        stages = [s for s in stages_of(schedule) if isinstance(s, PipelineStage)]
        if not pinned:
            for stage in stages:
                own = _OWN.pop(stage, None)
                if own is not None:
                    stage._user_meta = own
            continue
        settled = [_settled(stage) for stage in stages]
        if all(settled):
            _pin(stages, settled)  # type: ignore[arg-type]
        elif lent:
            _pin(stages, json.loads(lent))
    return len(known)


# -- shapes, recorded live and lent to a shadow ------------------------------------------


def _meta_json(meta: Any) -> dict[str, Any] | None:
    if not isinstance(meta, _TensorMeta):
        return None  # a DTensor's metadata: not lent (the shadow then needs the user's)
    return {
        "shape": list(meta.shape),
        "stride": list(meta.stride),
        "dtype": str(meta.dtype).removeprefix("torch."),
        "requires_grad": meta.requires_grad,
    }


def _meta_from(d: dict[str, Any]) -> _TensorMeta:
    dtype = getattr(torch, d["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {d['dtype']!r}")
    return _TensorMeta(
        shape=torch.Size(int(n) for n in d["shape"]),
        stride=tuple(int(n) for n in d["stride"]),
        dtype=dtype,
        requires_grad=bool(d["requires_grad"]),
    )


def _settled(stage: Any) -> dict[str, Any] | None:
    """The forward shapes `stage` settled on in its first step, as JSON; None before
    that, or for shapes that are not plain tensors'."""
    meta = getattr(stage, "_stage_meta", None)
    if meta is None or not meta.is_complete_for_forward():
        return None
    inputs = [_meta_json(m) for m in meta.inputs]
    outputs = [_meta_json(m) for m in meta.outputs]
    if None in inputs or None in outputs:
        return None
    return {"stage": stage.stage_index, "inputs": inputs, "outputs": outputs}


def describe() -> str:
    """The forward shapes of this rank's stages, as their first step settled them (JSON,
    one entry per stage, in schedule order); "" when it has none."""
    described = [_settled(s) for schedule in schedules() for s in stages_of(schedule)]
    return json.dumps(described) if described and all(described) else ""


def _pin(stages: list[Any], shapes: list[dict[str, Any]]) -> None:
    """Gives each stage whose user gave no shapes the `shapes` at its position."""
    for stage, given in zip(stages, shapes, strict=False):
        if not isinstance(stage, PipelineStage):
            continue
        own = _OWN.get(stage, stage._user_meta)
        if own.is_complete_for_forward():
            continue  # the user gave the shapes: they hold
        _OWN[stage] = own
        stage._user_meta = _StageMeta(
            inputs=tuple(_meta_from(m) for m in given["inputs"]),
            outputs=tuple(_meta_from(m) for m in given["outputs"]),
        )


@contextmanager
def lending(described: str) -> Iterator[None]:
    """While it lasts, the stages of every schedule built get the shapes `described`
    (`describe`'s JSON) where the user gave none."""
    global _LENT
    shapes = json.loads(described) if described else []
    with _LOCK:
        _LENT = shapes
    try:
        yield
    finally:
        with _LOCK:
            _LENT = None
