"""Planned migrations between real processes (gloo on loopback), checked against an
uninterrupted run of the same job and seed. See conftest.py for the two runs."""

from __future__ import annotations

import pytest
import torch

from trainmover.runtime.state import load_saved

from .conftest import CONFIG, SCENARIOS, Migration, Run

# The session runs are started by whichever test needs them first; see conftest.WAIT_S.
pytestmark = pytest.mark.timeout(1200)

ROLES = [r for cell in CONFIG.layout.cells() for r in CONFIG.layout.roles_of(cell)]
BY_NAME = pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=[s.name for s in SCENARIOS])


def test_loss_of_reference_job_falls_over_first_100_steps(reference_run: Run) -> None:
    losses = reference_run.losses
    assert sorted(losses) == list(range(1, 101))
    first, last = (
        sum(losses[s] for s in range(1, 11)) / 10,
        sum(losses[s] for s in range(91, 101)) / 10,
    )
    assert last < 0.6 * first, (first, last)


@BY_NAME
def test_state_after_migration_is_bit_identical_to_uninterrupted_run(
    index: int, reference_run: Run, migrated_run: Run
) -> None:
    step = SCENARIOS[index].check_at
    for role in ROLES:
        ours = load_saved(migrated_run.state_file(role.key, step))
        theirs = load_saved(reference_run.state_file(role.key, step))
        assert ours["header"] == theirs["header"], role.key  # step, data position, ...
        assert ours["tensors"].keys() == theirs["tensors"].keys()
        assert any(n.startswith("optim.") for n in ours["tensors"])
        for name, tensor in ours["tensors"].items():
            assert torch.equal(tensor, theirs["tensors"][name]), f"{role.key} {name}"


def _expected_delta(m: Migration) -> set[str]:
    roles = [r for move in m.plan.moves for r in move.roles]
    return set(CONFIG.layout.groups_containing(roles))


@BY_NAME
def test_only_the_leavers_groups_are_rebuilt(index: int, migrated_run: Run) -> None:
    m = migrated_run.migrations[index]
    delta = _expected_delta(m)
    assert {g.name for g in m.plan.groups} == delta
    rebuilt = {name for e in m.switched.values() if e.part != "leaver" for name in e.rebuilt}
    assert rebuilt == delta

    leavers, joiners = m.plan.leavers(), m.plan.joiners()
    gen_before = {g["name"]: g["generation"] for s in m.before.values() for g in s.groups.values()}
    for ref, after in m.after.items():
        assert ref.machine not in leavers
        for kind, group in after.groups.items():
            name = group["name"]
            if ref.machine in joiners:
                assert name in delta
                assert group["generation"] == gen_before[name] + 1
                continue
            old = m.before[ref].groups[kind]
            if name in delta:
                assert group["generation"] == old["generation"] + 1, (ref, name)
                assert group["incarnation"] != old["incarnation"]
            else:  # the very same group object, never touched
                assert group == old, (ref, name)
    untouched = {str(r) for r in m.after if r.machine not in joiners and not m.plan.specs_for(r)}
    assert untouched or index == len(SCENARIOS) - 1  # single moves leave machines alone


@BY_NAME
def test_training_continues_while_phase_one_runs(index: int, migrated_run: Run) -> None:
    m = migrated_run.migrations[index]
    stayers = {r: e for r, e in m.ready.items() if r.machine in m.plan.stayers()}
    assert stayers
    for ref, ready in stayers.items():
        # Prepared at `prepare_at`, switched at `switch_at`: the steps in between were
        # trained over the old groups while phase 1 ran.
        assert m.before[ref].step == m.scenario.prepare_at
        assert m.switched[ref].step == m.scenario.switch_at
        if m.scenario.staggered:  # there the overlap is provable, not just likely
            assert ready.steps_during_build >= 2, ref
