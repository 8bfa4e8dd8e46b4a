"""A commit(k) that splits the ranks (the leaver took k, a stayer had already passed it)
switches nobody: the leaver drops k, trains on with its peer, and a later commit moves it.
Real processes: a 1 x 1 x 2 job and a standby; the stayer is let past k while the leaver
is held at it, so the split is certain, not a race. Final parameters and optimizer state
are bit-identical to an uninterrupted run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from trainmover.localjob import LocalJob
from trainmover.runtime import control as c
from trainmover.runtime.plan import RankRef
from trainmover.runtime.state import load_saved

from .conftest import DP2, WAIT_S, worker_events

pytestmark = pytest.mark.timeout(600)

K, LATER, STEPS = 5, 8, 11
SPLIT_CONFIG = DP2.with_updates(train={"steps": STEPS, "dump_steps": [STEPS]})


def _wait_passed(job: LocalJob, ref: RankRef, step: int) -> None:
    """Until `ref` has left the boundary after `step` (it then waits in step + 1's
    all-reduce for its held peer); no event says so, so its status is polled."""
    deadline = time.monotonic() + WAIT_S
    while job.commands.status([ref])[ref].passed < step:
        assert time.monotonic() < deadline, f"{ref} never passed step {step}"
        time.sleep(0.05)


def test_a_commit_one_committer_refused_switches_nobody_and_a_later_one_moves(
    tmp_path: Path,
) -> None:
    with LocalJob.launch(SPLIT_CONFIG, tmp_path / "reference", standbys=0, timeout_s=WAIT_S) as job:
        job.finish(timeout_s=WAIT_S)

    run = tmp_path / "split"
    with LocalJob.launch(SPLIT_CONFIG, run, standbys=1, limit=K, timeout_s=WAIT_S) as job:
        joiner = job.standbys[0]
        plan = job.make_plan({"m0": joiner})
        job.wait_step(K, timeout_s=WAIT_S)
        job.prepare(plan)
        job.wait_ready(plan, timeout_s=WAIT_S)
        (leaver,), (stayer,) = job.ranks(["m0"]), job.ranks(["m1"])
        job.control.request(stayer, c.Advance(limit=K + 1), WAIT_S)
        _wait_passed(job, stayer, K)

        # The executor's order: the joiner, the leaver, then the stayer, which refuses.
        first = job.commands.offer_commit([*job.ranks([joiner]), leaver], plan, K)
        late = job.commands.offer_commit([stayer], plan, K)
        assert all(ack.accepted for ack in first.values())
        assert (late[stayer].accepted, late[stayer].reason) == (False, "too late")

        job.set_limit(LATER)  # the leaver crosses k without switching, both train on
        job.wait_step(LATER, timeout_s=WAIT_S)
        job.commit(plan, LATER)
        job.set_limit(STEPS)
        switched = job.wait_switched(plan, timeout_s=WAIT_S)
        # The planner applied the migration's end: roles, statuses, generations.
        machines = job.state.machines
        assert (machines["m0"].status, machines[joiner].status) == ("maintenance", "active")
        assert job.assignment[joiner] == plan.moves[0].cell and not job.state.in_flight
        assert all(job.generations[g.name] == g.generation == 1 for g in plan.groups)
        job.finish(timeout_s=WAIT_S)

    assert {e.step for e in switched.values()} == {LATER}
    for name in ("m0-0", f"{joiner}-0"):
        dropped = worker_events(run / "logs" / f"{name}.log", "switch_dropped")
        assert [e["step"] for e in dropped] == [K], name
    for role in ("d0p0t0", "d1p0t0"):
        ours = load_saved(run / "state" / f"{role}.step{STEPS}.pt")
        theirs = load_saved(tmp_path / "reference" / "state" / f"{role}.step{STEPS}.pt")
        assert ours["header"] == theirs["header"], role
        assert ours["tensors"].keys() == theirs["tensors"].keys()
        assert any(n.startswith("optim.") for n in ours["tensors"])
        for name, tensor in ours["tensors"].items():
            assert torch.equal(tensor, theirs["tensors"][name]), f"{role} {name}"
