"""The soak's invariant checks on hand-made inputs: each catches what it is meant to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainmover.chaos.invariants import check_accounting, check_replicas, has_come_back
from trainmover.chaos.report import SoakSettings, longest_stall, lost_time
from trainmover.chaos.soak import soak_config
from trainmover.messages import ClusterState, Heartbeat, MachineState, WorkerStatus
from trainmover.runtime.layout import MachineRole

CONFIG = soak_config(dump_every=10)


def _save(run: Path, machine: str, role: str, step: int, weight: float, adam_step: int = 3):
    path = run / machine / "state" / f"{role}.step{step}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"step": step, "stateful": {"data": {"pos": hash(role)}}, "optim_scalars": {"0": {}}}
    tensors = {
        "model.w": torch.full((3,), weight),
        "optim.0.step": torch.tensor(float(adam_step)),
        "rng.torch": torch.randint(0, 255, (8,), dtype=torch.uint8),  # per replica
    }
    torch.save({"header": header, "tensors": tensors}, path)


def _all_roles(run: Path, step: int, weight_of=lambda role: 1.0) -> None:
    lay = CONFIG.layout
    for dp in range(lay.dp):
        for pp in range(lay.pp):
            for tp in range(lay.tp):
                role = f"d{dp}p{pp}t{tp}"
                _save(run, f"m{dp * lay.pp + pp}", role, step, weight_of(role) + pp + tp / 10)


def test_replicas_that_agree_pass(tmp_path: Path) -> None:
    _all_roles(tmp_path, 20)
    assert check_replicas(CONFIG, tmp_path, 20) == []


def test_a_replica_one_step_ahead_is_caught(tmp_path: Path) -> None:
    _all_roles(tmp_path, 20, weight_of=lambda role: 2.0 if role == "d1p1t0" else 1.0)
    (violation,) = check_replicas(CONFIG, tmp_path, 20)
    assert "replicas d0 and d1 of p1t0 differ" in violation and "model.w" in violation


def test_a_missing_rank_and_a_diverged_duplicate_are_caught(tmp_path: Path) -> None:
    _all_roles(tmp_path, 20)
    (tmp_path / "m0" / "state" / "d0p0t1.step20.pt").unlink()
    _save(tmp_path, "s0", "d1p0t0", 20, weight=5.0)  # the role saved again, differently
    violations = check_replicas(CONFIG, tmp_path, 20)
    assert any("d0p0t1 saved no state" in v for v in violations)
    assert any("d1p0t0 saved twice, differently" in v for v in violations)


def _state(**statuses: tuple[str, MachineRole | None]) -> ClusterState:
    return ClusterState(
        job=CONFIG.job,
        layout=CONFIG.layout,
        machines={n: MachineState(status=s, cell=c) for n, (s, c) in statuses.items()},
    )


def _beat(machine: str, status: str, exited: bool = False) -> Heartbeat:
    worker = WorkerStatus(
        local_rank=0,
        pid=1,
        state="exited" if exited else "running",
        exit_code=9 if exited else None,
    )
    return Heartbeat(job=CONFIG.job, machine=machine, seq=1, status=status, workers=[worker])


def _healthy() -> tuple[dict, dict]:
    cells = CONFIG.layout.cells()
    machines = {f"m{i}": ("active", cell) for i, cell in enumerate(cells)}
    machines |= {"s0": ("standby", None), "s1": ("standby", None)}
    beats = {n: _beat(n, s) for n, (s, _) in machines.items()}
    return machines, beats


def test_a_settled_cluster_is_accounted_for() -> None:
    machines, beats = _healthy()
    assert check_accounting(CONFIG, _state(**machines), beats, set()) == []


def test_accounting_catches_a_lost_machine_a_gap_and_a_disagreement() -> None:
    machines, beats = _healthy()
    machines["s1"] = ("failed", None)  # failed, and nobody brings it back
    machines["m3"] = ("standby", None)  # its cell is left without an active machine
    beats["m1"] = _beat("m1", "standby")  # the sidecar thinks otherwise than the planner
    beats["m2"] = _beat("m2", "active", exited=True)
    violations = check_accounting(CONFIG, _state(**machines), beats, set())
    assert any("s1 is failed and nobody brings it back" in v for v in violations)
    assert any("cell dp1 pp1 has 0 active machines" in v for v in violations)
    assert any("m1: planner says active, its sidecar says standby" in v for v in violations)
    assert any("m2 is active with an exited worker" in v for v in violations)
    # A machine the soak is bringing back may be failed meanwhile.
    machines, beats = _healthy()
    machines["s1"] = ("failed", None)
    assert check_accounting(CONFIG, _state(**machines), beats, {"s1"}) == []


def test_settings_refuse_unknown_fault_kinds() -> None:
    with pytest.raises(ValueError, match="unknown fault kinds \\['power'\\]"):
        SoakSettings(kinds=("drain", "power"))


def test_a_bus_node_kill_needs_a_bus_cluster() -> None:
    with pytest.raises(ValueError, match="--nats-cluster 3"):
        SoakSettings(kinds=("drain", "nats_node_kill"))
    assert "nats_node_kill" not in SoakSettings().kinds
    assert SoakSettings(kinds=("nats_node_kill",), nats_cluster=3).nats_cluster == 3


def test_store_shards_are_refused_beyond_the_jobs_machines() -> None:
    with pytest.raises(ValueError, match="--store-shards 5: from 0 to the job's 4 machines"):
        SoakSettings(store_shards=5)
    with pytest.raises(ValueError, match="--store-shards -1"):
        SoakSettings(store_shards=-1)


def test_a_returning_machine_taken_as_a_joiner_has_come_back() -> None:
    assert has_come_back("standby", was_away=False)
    assert has_come_back("active", was_away=True)  # back, and taken straight from the pool
    assert has_come_back("joining", was_away=True)
    # A drained leaver still serving its role has not even left yet.
    assert not has_come_back("active", was_away=False)
    assert not has_come_back("maintenance", was_away=True)
    assert not has_come_back("failed", was_away=True)


def test_lost_time_is_the_stamped_gap_less_the_steps_done() -> None:
    """From the machines' stamps: 10 steps of 0.1 s over 1.5 s lost 0.5 s; a window with
    as many steps as its time allows lost nothing, and one faster than before, nothing
    either (never negative)."""
    assert lost_time((100.0, 50), (101.5, 60), 0.1) == 0.5
    assert lost_time((100.0, 50), (101.0, 60), 0.1) == 0.0
    assert lost_time((100.0, 50), (100.5, 60), 0.1) == 0.0


def test_the_longest_stall_tells_one_hold_from_steps_slowed_throughout() -> None:
    """The same 0.5 s lost, once in one gap (a stall of 0.5 s), once spread over ten
    slower steps (none held more than 0.05 s); points before the fault do not count."""
    held = [
        (99.0, 40),
        (100.0, 50),
        (100.1, 51),
        (100.7, 52),
        *((100.7 + 0.1 * i, 52 + i) for i in range(1, 9)),
    ]
    assert lost_time((100.0, 50), held[-1], 0.1) == 0.5
    assert longest_stall(held, (100.0, 50), 0.1) == 0.5
    slowed = [(95.0, 40), (100.0, 50), *((100.0 + 0.15 * i, 50 + i) for i in range(1, 11))]
    assert lost_time((100.0, 50), slowed[-1], 0.1) == 0.5
    assert longest_stall(slowed, (100.0, 50), 0.1) == 0.05
    assert longest_stall([(100.0, 50)], (100.0, 50), 0.1) == 0.0
