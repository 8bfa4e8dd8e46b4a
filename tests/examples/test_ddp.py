"""examples/ddp: the TrainMover version of a torchrun DDP script, run as real processes.

Two runs of the same job and seed (DP=2, one rank per machine): an uninterrupted one,
and one with a warm standby taking over m0 in a planned migration, then two machines
SIGKILLed mid-step (m1 while its gradient all-reduce inside DDP's reducer is in flight,
the first joiner after its all-reduce, before the commit vote), each recovered from its
data-parallel replica. Both runs dump every role's full state (parameters, AdamW state,
data position) at the last step; they must be bit-identical. The same at DP=3, where a
replaced rank sits between two stayers of a larger gloo group: the middle machine moves,
then the last dies inside DDP's all-reduce.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from trainmover.examples.ddp import train, train_trainmover
from trainmover.localjob import LocalJob
from trainmover.runtime import control as c
from trainmover.runtime.config import JobConfig
from trainmover.runtime.plan import RankRef
from trainmover.runtime.reports import RecoveryReport

ENTRY = "trainmover.examples.ddp.train_trainmover"
STEPS = 14
WAIT_S = 300.0
CONFIG = JobConfig(
    job="ddp-example",
    layout={"tp": 1, "pp": 1, "dp": 2},
    cluster={"machines": ["m0", "m1"]},
    train={"steps": STEPS, "dump_steps": [STEPS]},
    runtime={"group_timeout_s": 60, "failure_timeout_s": 60},
)
PLANNED_AT = 4
#: (machine, step, point): m1 dies inside DDP's all-reduce, then s0 (m0's joiner).
FAULTS = [("m1", 7, "dp-allreduce"), ("s0", 10, "after-allreduce")]
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    run_dir: Path
    losses: dict[int, float]
    warmed: dict[RankRef, c.Warmed] | None = None
    recoveries: list[RecoveryReport] | None = None

    steps: int = STEPS

    def state(self, role_key: str) -> dict[str, torch.Tensor]:
        path = self.run_dir / "state" / f"{role_key}.step{self.steps}.pt"
        return torch.load(path, weights_only=False)["tensors"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("ddp-reference")
    with LocalJob.launch(CONFIG, run_dir, standbys=0, entry=ENTRY, timeout_s=WAIT_S) as job:
        job.finish(timeout_s=WAIT_S)
        return Run(run_dir, job.losses())


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("ddp-moved")
    env = {"TM_TEST_FAULT": ",".join(f"{m}@{s}:{p}" for m, s, p in FAULTS)}
    with LocalJob.launch(
        CONFIG, run_dir, standbys=3, entry=ENTRY, timeout_s=WAIT_S, limit=2, extra_env=env
    ) as job:
        job.wait_step(2)
        warmed = job.warm(timeout_s=WAIT_S)  # shadow iterations of the user's DDP
        job.set_limit(PLANNED_AT)  # held there until the switch: no fault fires before it
        report = job.migrate({"m0": "s0"}, at_step=PLANNED_AT)
        assert report.commit_step == PLANNED_AT
        job.set_limit(STEPS)
        recoveries = []
        for _ in FAULTS:
            dead, noticed = job.wait_failure(timeout_s=WAIT_S)
            recoveries.append(job.recover(dead, detected_at=noticed, timeout_s=WAIT_S))
        job.finish(timeout_s=WAIT_S)
        return Run(run_dir, job.losses(), warmed, recoveries)


def dp_roles(dp: int) -> list[str]:
    return [f"d{d}p0t0" for d in range(dp)]


def assert_bit_identical(moved: Run, reference: Run, roles: list[str]) -> None:
    """Every role's parameters, optimizer state and data position, and the losses."""
    for role_key in roles:
        ours, theirs = moved.state(role_key), reference.state(role_key)
        assert ours.keys() == theirs.keys()
        assert any(k.startswith("optim.") for k in ours)  # AdamW's state is compared too
        for name, value in ours.items():
            if not name.startswith("rng."):
                assert torch.equal(value, theirs[name]), (role_key, name)
    assert moved.losses == reference.losses


def test_a_moved_ddp_job_ends_bit_identical_to_an_uninterrupted_one(reference, moved):
    assert_bit_identical(moved, reference, dp_roles(2))


def test_failures_recover_from_the_replica_and_re_execute_the_lost_step(moved):
    assert moved.recoveries is not None
    assert [r.step for r in moved.recoveries] == [s - 1 for _, s, _ in FAULTS]


def test_the_standby_warmed_by_running_ddp_inside_the_sandbox(moved):
    assert moved.warmed is not None
    assert len(moved.warmed) == 3  # every standby
    for warmed in moved.warmed.values():
        assert warmed.error == "" and warmed.role_types == ["only"]
        assert not warmed.store_known  # no path to the live job
        # DDP's start-up checks and each iteration's all-reduce, all answered locally
        assert warmed.synthesized >= 2


def assert_docs_show_the_diff(plain: ModuleType, under_trainmover: ModuleType) -> None:
    """docs/integration.md shows exactly the diff between the two scripts' `main`."""
    before = inspect.getsource(plain.main).splitlines()
    after = inspect.getsource(under_trainmover.main).splitlines()
    diff = "\n".join(
        difflib.unified_diff(before, after, "train.py", "train_trainmover.py", lineterm="")
    )
    docs = (ROOT / "docs" / "integration.md").read_text()
    assert f"```diff\n{diff}\n```" in docs


def test_the_docs_show_exactly_the_examples_diff():
    assert_docs_show_the_diff(train, train_trainmover)


# -- DP=3 --------------------------------------------------------------------------------

STEPS3 = 9
CONFIG3 = CONFIG.with_updates(
    layout={"dp": 3},
    cluster={"machines": ["m0", "m1", "m2"]},
    train={"steps": STEPS3, "dump_steps": [STEPS3]},
)
PLANNED3_AT = 3
FAULTS3 = [("m2", 6, "dp-allreduce")]


def test_at_dp3_a_moved_middle_rank_and_a_failure_end_bit_identical(tmp_path: Path) -> None:
    with LocalJob.launch(
        CONFIG3, tmp_path / "ref", standbys=0, entry=ENTRY, timeout_s=WAIT_S
    ) as job:
        job.finish(timeout_s=WAIT_S)
        reference = Run(tmp_path / "ref", job.losses(), steps=STEPS3)
    env = {"TM_TEST_FAULT": ",".join(f"{m}@{s}:{p}" for m, s, p in FAULTS3)}
    with LocalJob.launch(
        CONFIG3, tmp_path / "moved", standbys=2, entry=ENTRY, timeout_s=WAIT_S, limit=2,
        extra_env=env,
    ) as job:  # fmt: skip
        job.wait_step(2)
        job.warm(timeout_s=WAIT_S)
        job.set_limit(PLANNED3_AT)
        report = job.migrate({"m1": "s0"}, at_step=PLANNED3_AT)
        assert report.commit_step == PLANNED3_AT
        job.set_limit(STEPS3)
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        assert dead == "m2"
        recovery = job.recover(dead, detected_at=noticed, timeout_s=WAIT_S)
        assert recovery.step == FAULTS3[0][1] - 1
        job.finish(timeout_s=WAIT_S)
        moved = Run(tmp_path / "moved", job.losses(), steps=STEPS3)
    assert_bit_identical(moved, reference, dp_roles(3))
