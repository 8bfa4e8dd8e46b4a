"""The reconfigurable c10d groups between real processes on loopback (`c10d_rank.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.c10d_rank import ABORTED
from trainmover.runtime.tcpstore import serve

SIZE = 2
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("c10d")
    store = serve("127.0.0.1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.runtime.c10d_rank",
                str(r),
                str(SIZE),
                str(store.port),
                str(out / f"{r}.pt"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(SIZE)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=240)
        assert p.returncode == 0, output.decode()[-3000:]
    return [torch.load(out / f"{r}.pt", weights_only=False) for r in range(SIZE)]


def test_ddp_over_a_swapped_group_stays_bit_identical_to_an_unswapped_one(ranks):
    for result in ranks:
        assert result["same_object"]  # DDP keeps the very same group object
        assert result["a"].keys() == result["b"].keys()
        for name, value in result["a"].items():
            assert torch.equal(value, result["b"][name]), name
    # ... and the replicas agree with each other (DDP really reduced across processes)
    for name, value in ranks[0]["a"].items():
        assert torch.equal(value, ranks[1]["a"][name]), name


def test_functional_collectives_and_dist_wrappers_find_the_group_by_name(ranks):
    total = float(sum(range(1, SIZE + 1)))
    for rank, result in enumerate(ranks):
        assert result["funcol_before"].tolist() == [total, total]
        assert result["funcol_after"].tolist() == [total, total]  # the new inner group
        assert result["broadcast_after"].tolist() == [1.0, 1.0, 1.0]
        assert result["rank"] == rank and result["world"] == SIZE


def test_waited_collectives_leave_the_group_clean_and_unremembered(ranks):
    for result in ranks:
        assert result["bookkeeping"] == {"dirty": False, "kept": 0, "sum": [2.0, 2.0]}


def test_init_process_group_installs_the_runtime_group(ranks):
    assert all(r["default_is_dp"] for r in ranks)


def test_bad_input_is_refused_with_the_call_and_the_fix(ranks):
    result = ranks[0]
    assert (
        f"world_size={SIZE + 1}" in result["mismatch"]
        and f"world_size={SIZE}" in result["mismatch"]
    )
    assert "dist.new_group" in result["new_group"] and "rt.process_group" in result["new_group"]
    assert "recv_anysource" in result["anysource"] and "explicit source" in result["anysource"]


def test_sends_and_receives_over_the_c10d_group_arrive_and_are_tapped(ranks):
    assert ranks[1]["p2p"]["got"].tolist() == [0.0, 1.0, 2.0, 3.0]
    tapped = ranks[1]["p2p"]["tapped"]
    assert [tag for tag, _ in tapped] == [7, 8]
    assert tapped[1][1].tolist() == [9.0, 9.0]
    assert ranks[0]["p2p"]["tapped"] == []  # a sender records nothing


@pytest.mark.parametrize("collective", ABORTED)
def test_a_c10d_wait_on_a_peer_that_never_posts_ends_with_the_abort(ranks, collective):
    aborted = ranks[0]["aborted"][collective]
    assert "a peer is gone" in aborted["error"]  # the abort, not the group's timeout
    assert aborted["dirty"]  # an abandoned work: a recovery rebuilds the group
