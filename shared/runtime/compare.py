"""Compares the saved training states of two runs, role by role, bit for bit.

A run saves every role's full state (parameters, optimizer state, step, data position,
RNG) after the steps of `train.dump_steps`, as `<run_dir>/.../state/<role>.step<N>.pt`;
a migrated run is correct when every one of its files equals the uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainmover.runtime.state import load_saved


def state_files(root: Path, step: int) -> dict[str, Path]:
    """Role key -> the state file saved after `step`, anywhere under `root`."""
    suffix = f".step{step}.pt"
    return {p.name.removesuffix(suffix): p for p in sorted(root.rglob(f"state/*{suffix}"))}


def mismatches(ours: dict[str, Path], reference: dict[str, Path]) -> list[str]:
    """Every difference between two runs' states (empty when bit-identical)."""
    out = []
    for role in sorted(set(ours) | set(reference)):
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
