"""Periodic per-rank checkpoints, and the last checkpoint common to every role.

The fallback when a failed machine's roles have no data-parallel replica (DP=1): every
rank writes its full `TrainingState` (with its step) every `runtime.checkpoint_every`
committed steps, atomically (temporary file, then rename), into a directory that every
machine can read (`runtime.checkpoint_dir`; default `<run_dir>/checkpoints`), keeping the
last `KEEP`. Because of the commit agreement, no two ranks are more than one step apart at
a boundary, so the newest checkpoint of the slowest role is still kept by every other
role; a checkpoint restore agrees on that step through the store and every rank of the
job (the joiner reading the dead role's files) reloads it.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

from trainmover.runtime.layout import Role
from trainmover.runtime.state import TrainingState, load_saved
from trainmover.runtime.storeclient import Store

#: Checkpoints kept per role.
KEEP = 2
_NAME = re.compile(r"^step(\d+)\.pt$")


def role_dir(root: Path, role: Role) -> Path:
    return root / role.key


def steps_of(root: Path, role: Role) -> list[int]:
    """Steps of the complete checkpoints of `role`, oldest first."""
    folder = role_dir(root, role)
    if not folder.is_dir():
        return []
    found = (_NAME.match(p.name) for p in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def write(root: Path, role: Role, state: TrainingState) -> Path:
    """Writes `state` as the checkpoint of `role` at its step; prunes old ones."""
    folder = role_dir(root, role)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step{state.step}.pt"
    state.save(path)  # atomic: a reader never sees a partial file
    for old in steps_of(root, role)[:-KEEP]:
        (folder / f"step{old}.pt").unlink(missing_ok=True)
    return path


class NoCheckpoint(RuntimeError):
    """A checkpoint restore with no checkpoint of some role to restore: the job cannot go
    on from saved state, and must not start over from step 0 unnoticed."""


def agree_step(
    store: Store,
    prefix: str,
    role: Role,
    roles: list[Role],
    root: Path,
    timeout_s: float,
    every: int = 0,
) -> int:
    """The newest step every role of the job has a checkpoint of. Each rank publishes its
    role's newest step under `prefix` (the joiner publishes the dead role's), then all
    read all and take the minimum, so every rank loads the same step. NoCheckpoint, on
    every rank alike, when some role has none (`every`: runtime.checkpoint_every, for
    the message)."""
    newest = steps_of(root, role)
    store.set(f"{prefix}ckpt/{role.key}", json.dumps(newest[-1] if newest else 0))
    keys = [f"{prefix}ckpt/{r.key}" for r in roles]
    store.wait(keys, timedelta(seconds=timeout_s))
    steps = {r.key: int(json.loads(store.get(k))) for r, k in zip(roles, keys, strict=True)}
    missing = sorted(key for key, step in steps.items() if step == 0)
    if missing:
        why = (
            "the job writes none (runtime.checkpoint_every is 0)"
            if every == 0
            else f"none was written yet (runtime.checkpoint_every is {every})"
        )
        raise NoCheckpoint(
            f"no state to recover from: no live data-parallel replica of the failed roles, "
            f"and no checkpoint of {', '.join(missing)} in {root}: {why}; the job stops "
            "here instead of starting over from step 0"
        )
    return min(steps.values())


def load(root: Path, role: Role, step: int, state: TrainingState) -> None:
    """Restores `state` from the checkpoint of `role` at `step` (step 0: the initial
    state, which every rank rebuilt identically from the seed)."""
    if step == 0:
        if state.step != 0:
            raise RuntimeError(f"no checkpoint of {role.key} to restore step 0 from")
        return
    saved = load_saved(role_dir(root, role) / f"step{step}.pt")
    state.restore(saved["header"], saved["tensors"])
