"""Unplanned failures between real processes (gloo on loopback): a machine is SIGKILLed
mid-step and recovered, from a DP replica (TP2 x PP2 x DP2) or from the last common
checkpoint (DP=1); and shadow iterations of standbys. See conftest.py for the runs."""

from __future__ import annotations

import statistics
from collections import defaultdict

import pytest
import torch

from trainmover.runtime.plan import RankRef
from trainmover.runtime.state import load_saved

from .conftest import (
    CHECKPOINT_EVERY,
    CHECKPOINT_FAULT,
    CONFIG,
    FAULTS,
    MIGRATED_STEPS,
    Run,
)

pytestmark = pytest.mark.timeout(1500)

ROLES = [r for cell in CONFIG.layout.cells() for r in CONFIG.layout.roles_of(cell)]
BY_FAULT = pytest.mark.parametrize(
    "index", range(len(FAULTS)), ids=[f"{m}@{s}:{p}" for m, s, p in FAULTS]
)


@BY_FAULT
def test_every_rank_resumes_from_the_step_before_the_kill(index: int, failure_run: Run) -> None:
    machine, step, _ = FAULTS[index]
    report = failure_run.recoveries[index]
    assert report.dead == machine
    # The killed machine never voted for `step`: nobody applied it, everyone resumes
    # from step - 1 (RecoveryReport.step raises if two ranks disagree).
    assert report.step == step - 1
    assert len(report.switched) == len(ROLES)  # every live rank and the joiner
    parts = {e.part for e in report.switched.values()}
    assert parts == {"joiner", "source", "stayer"}
    assert {e.source for e in report.switched.values()} == {"replica"}
    joiner = report.plan.moves[0].joiner
    assert all(report.switched[r].part == "joiner" for r in report.switched if r.machine == joiner)
    assert report.plan.moves[0].source is not None  # the DP replica sent the state


@BY_FAULT
def test_replicas_hold_identical_state_after_each_recovery(index: int, failure_run: Run) -> None:
    """The commit agreement never lets DP replicas diverge: after the recovery, the two
    replicas of every (stage, tp) role hold the same step, parameters and optimizer."""
    by_role: dict[tuple[int, int], set[str]] = defaultdict(set)
    switched = failure_run.recoveries[index].switched
    statuses = {ref: event.digest for ref, event in switched.items()}
    for ref, digest in statuses.items():
        role = _role_of(failure_run, index, ref.machine, ref.local_rank)
        by_role[(role.pp, role.tp)].add(digest)
    assert len(by_role) == CONFIG.layout.pp * CONFIG.layout.tp
    for key, digests in by_role.items():
        assert len(digests) == 1, key


@BY_FAULT
def test_in_flight_step_is_reexecuted_with_the_same_data(
    index: int, failure_run: Run, reference_run: Run
) -> None:
    _, step, _ = FAULTS[index]
    # Stayers discarded the step they were in and reported it; the step then ran once,
    # after the recovery, and produced exactly the uninterrupted run's loss.
    aborted_steps = {e.step for events in failure_run.aborted.values() for e in events}
    assert step in aborted_steps
    assert failure_run.losses[step] == reference_run.losses[step]
    committed = [e.step for _, e in failure_run.history if e.step == step]
    assert len(committed) == len(ROLES)  # committed once per rank, never twice


def test_collective_errors_blame_only_killed_machines(failure_run: Run) -> None:
    # A direct neighbour of a killed machine that sees its connection close before the
    # epoch's abort reaches it (the two race) reports the error and names the peer;
    # nobody ever blames a live machine.
    blamed = {e.peer_machine for _, e in failure_run.collective_errors}
    assert blamed and blamed <= {m for m, _, _ in FAULTS} | {None}
    assert all(e.error for _, e in failure_run.collective_errors)


def test_final_state_is_bit_identical_to_an_uninterrupted_run(
    failure_run: Run, reference_run: Run
) -> None:
    for role in ROLES:
        ours = load_saved(failure_run.state_file(role.key, MIGRATED_STEPS))
        theirs = load_saved(reference_run.state_file(role.key, MIGRATED_STEPS))
        assert ours["header"] == theirs["header"], role.key
        for name, tensor in ours["tensors"].items():
            assert torch.equal(tensor, theirs["tensors"][name]), f"{role.key} {name}"
    assert sorted(failure_run.losses) == list(range(1, MIGRATED_STEPS + 1))


def test_after_the_recoveries_no_rank_computes_much_longer_than_the_others(
    failure_run: Run,
) -> None:
    """The straggler signal stays flat across recoveries: joiners, sources and stayers
    alike compute about as long per step as the others (a generous factor: this is the
    absence of a false straggler, not a timing claim)."""
    last = max(report.step for report in failure_run.recoveries)
    times: dict[RankRef, list[float]] = defaultdict(list)
    for ref, event in failure_run.history:
        if event.step > last + 3 and event.compute_s is not None:  # joiners warm up first
            assert event.compute_s <= event.seconds
            times[ref].append(event.compute_s)
    assert len(times) == len(ROLES)
    medians = {ref: statistics.median(t) for ref, t in times.items()}
    job = statistics.median(medians.values())
    assert all(m < 2 * job for m in medians.values()), (job, medians)


def test_dp1_failure_falls_back_to_the_last_common_checkpoint(checkpoint_run: Run) -> None:
    machine, step, _ = CHECKPOINT_FAULT
    (report,) = checkpoint_run.recoveries
    assert report.dead == machine
    assert report.plan.restore == "checkpoint" and not report.plan.transfers
    # The event says so, and every rank reloaded the same (newest common) checkpoint.
    assert {e.source for e in report.switched.values()} == {"checkpoint"}
    expected = (step - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    assert report.step == expected
    # The steps between the checkpoint and the failure ran twice, identically.
    losses: dict[int, list[float]] = defaultdict(list)
    for _, event in checkpoint_run.history:
        if event.loss is not None:
            losses[event.step].append(event.loss)
    for s in range(expected + 1, step):
        assert len(losses[s]) == 4 and len(set(losses[s])) == 1, (s, losses[s])
    assert sorted(checkpoint_run.losses) == list(range(1, 17))


def test_standbys_warm_every_role_type_without_the_store(migrated_run: Run) -> None:
    assert migrated_run.warmed
    for ref, warmed in migrated_run.warmed.items():
        assert warmed.role_types == ["first", "last"], ref
        assert not warmed.store_known  # no path to the live job's rendezvous
        assert all(len(t) == 2 for t in warmed.iteration_s.values())
        # Pipeline receives replayed from step 1's recordings; the DP all-reduce
        # answered locally; the machine's own TP group ran for real in the sandbox.
        assert warmed.replayed > 0 and warmed.synthesized > 0 and warmed.local > 0
        assert warmed.kept_bytes == 0
    records = migrated_run.run_dir / "records"
    assert sorted(p.name for p in records.iterdir()) == ["first.pp-recv.pt", "last.pp-recv.pt"]


def _role_of(run: Run, index: int, machine: str, local_rank: int):  # noqa: ANN202
    """The role `machine` plays after recovery `index` (from the plans)."""
    cells = {f"m{i}": cell for i, cell in enumerate(CONFIG.layout.cells())}
    for report in run.recoveries[: index + 1]:
        for move in report.plan.moves:
            cells[move.joiner] = move.cell
    cell = cells[machine]
    return CONFIG.layout.roles_of(cell)[local_rank]
