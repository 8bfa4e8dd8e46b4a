"""Compares the saved training states of two runs, role by role, bit for bit.

A run saves every role's full state (parameters, optimizer state, step, data position,
RNG) after the steps of `train.dump_steps`, as `<run_dir>/.../state/<role>.step<N>.pt`;
a migrated run is correct when every one of its files equals the uninterrupted run's.
A role's state a run could not save (its rank died after the step, and its joiner holds
a DP replica's RNGs: `trainmover.runtime.dumps`) is marked `<role>.step<N>.skipped`
instead, and is not compared.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from trainmover.runtime.state import load_saved


def state_files(root: Path, step: int) -> dict[str, Path]:
    """Role key -> the state file saved after `step`, anywhere under `root`."""
    suffix = f".step{step}.pt"
    return {p.name.removesuffix(suffix): p for p in sorted(root.rglob(f"state/*{suffix}"))}


def skip_marker(state_dir: Path, role: str, step: int) -> Path:
    """Where a run says it could not save `role`'s state after `step`."""
    return state_dir / f"{role}.step{step}.skipped"


def skipped_roles(root: Path, step: int) -> set[str]:
    """The roles whose state after `step` a run under `root` marked as not saved."""
    suffix = f".step{step}.skipped"
    return {p.name.removesuffix(suffix) for p in root.rglob(f"state/*{suffix}")}


def mismatches(
    ours: dict[str, Path], reference: dict[str, Path], excused: Collection[str] = ()
) -> list[str]:
    """Every difference between two runs' states (empty when bit-identical); a role of
    `excused` (our run marked it not saved) missing from ours is not one."""
    out = []
    for role in sorted(set(ours) | set(reference)):
        if role not in ours and role in excused:
            continue
        if role not in ours or role not in reference:
            out.append(f"{role}: saved by only one run")
            continue
        a, b = load_saved(ours[role]), load_saved(reference[role])
        if a["header"] != b["header"]:
            out.append(f"{role}: header differs ({a['header']} vs {b['header']})")
        if a["tensors"].keys() != b["tensors"].keys():
            out.append(f"{role}: different tensors")
            continue
        out += [
            f"{role}: {name} differs"
            for name, t in a["tensors"].items()
            if not torch.equal(t, b["tensors"][name])
        ]
    return out
