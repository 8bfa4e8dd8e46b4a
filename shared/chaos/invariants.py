"""The invariants the chaos soak checks after every recovery, as pure functions.

- replicas: at a dump step every role saved its state once (or identically on two
  machines), at that step, and data-parallel replicas of one (pp, tp) hold bit-identical
  parameters and optimizer state, so no replica applied a step the other did not;
- accounting: every machine of the job is in the planner's cluster state, each cell of
  the layout has exactly one active machine, no migration is in flight or queued, and
  what each sidecar says of itself (its heartbeat) matches the planner's view.

Each function returns the violations it found (empty when the invariant holds).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from trainmover.messages import ClusterState, Heartbeat
from trainmover.runtime.config import JobConfig
from trainmover.runtime.state import load_saved


def dump_files(run_dir: Path, step: int) -> dict[str, list[Path]]:
    """Role key -> every state file saved after `step` (a role moved mid-run may have
    been saved by two machines)."""
    found: dict[str, list[Path]] = defaultdict(list)
    suffix = f".step{step}.pt"
    for path in sorted(run_dir.rglob(f"state/*{suffix}")):
        found[path.name.removesuffix(suffix)].append(path)
    return dict(found)


def _replicated(saved: dict) -> dict[str, torch.Tensor]:
    """What replicas share: parameters and optimizer state, not RNGs or data position."""
    return {n: t for n, t in saved["tensors"].items() if not n.startswith("rng.")}


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return ["different tensors"]
    return [name for name, t in a.items() if not torch.equal(t, b[name])]


def check_replicas(config: JobConfig, run_dir: Path, step: int) -> list[str]:
    """The dump invariant at `step` (see the module docstring)."""
    files = dump_files(run_dir, step)
    lay = config.layout
    expected = {
        f"d{dp}p{pp}t{tp}" for dp in range(lay.dp) for pp in range(lay.pp) for tp in range(lay.tp)
    }
    out = [f"step {step}: {role} saved no state" for role in sorted(expected - files.keys())]
    states: dict[str, dict] = {}
    for role, paths in sorted(files.items()):
        first = load_saved(paths[0])
        if first["header"]["step"] != step:
            out.append(f"step {step}: {role} saved step {first['header']['step']}")
        for again in paths[1:]:
            diff = _differences(first["tensors"], load_saved(again)["tensors"])
            if diff:
                out.append(f"step {step}: {role} saved twice, differently: {diff[:3]}")
        states[role] = first
    for pp in range(lay.pp):
        for tp in range(lay.tp):
            base = states.get(f"d0p{pp}t{tp}")
            for dp in range(1, lay.dp):
                other = states.get(f"d{dp}p{pp}t{tp}")
                if base is None or other is None:
                    continue
                diff = _differences(_replicated(base), _replicated(other))
                if base["header"]["optim_scalars"] != other["header"]["optim_scalars"]:
                    diff.append("optimizer step counts")
                if diff:
                    out.append(
                        f"step {step}: replicas d0 and d{dp} of p{pp}t{tp} differ: {diff[:3]}"
                    )
    return out


def has_come_back(status: str, was_away: bool) -> bool:
    """Whether a machine on its way back to the pool is back: a standby again, or one
    seen failed or in maintenance that is now joining or active (the planner may take a
    fresh standby as a joiner before anyone observes it in the pool)."""
    return status == "standby" or (was_away and status in ("joining", "active"))


def check_accounting(
    config: JobConfig,
    state: ClusterState,
    beats: dict[str, Heartbeat],
    returning: set[str],
) -> list[str]:
    """The standby-accounting invariant; `returning` are machines on their way back to
    the pool (killed and restarted by the soak, or drained into maintenance), which may
    be failed or in maintenance meanwhile."""
    out = []
    everyone = {*config.cluster.machines, *config.cluster.standbys}
    missing = everyone - state.machines.keys()
    if missing:
        out.append(f"machines missing from the cluster state: {sorted(missing)}")
    unknown = state.machines.keys() - everyone
    if unknown:
        out.append(f"machines the job does not have: {sorted(unknown)}")
    if state.in_flight or state.queued:
        out.append(f"not settled: {len(state.in_flight)} in flight, {len(state.queued)} queued")
    cells: dict[tuple[int, int], list[str]] = defaultdict(list)
    for name, m in state.machines.items():
        if m.status == "active":
            if m.cell is None:
                out.append(f"{name} is active without a cell")
            else:
                cells[(m.cell.dp, m.cell.pp)].append(name)
        elif m.status == "standby" and m.cell is not None:
            out.append(f"standby {name} holds cell {m.cell}")
        elif m.status not in ("standby",) and name not in returning:
            out.append(f"{name} is {m.status} and nobody brings it back")
    for cell in config.layout.cells():
        holders = cells.get((cell.dp, cell.pp), [])
        if len(holders) != 1:
            out.append(f"cell dp{cell.dp} pp{cell.pp} has {len(holders)} active machines {holders}")
    for name, m in state.machines.items():
        beat = beats.get(name)
        if m.status in ("active", "standby") and name not in returning:
            if beat is None:
                out.append(f"{name} is {m.status} but never sent a heartbeat")
            elif beat.status != m.status:
                out.append(f"{name}: planner says {m.status}, its sidecar says {beat.status}")
            elif any(w.state == "exited" for w in beat.workers):
                out.append(f"{name} is {m.status} with an exited worker")
    return out
