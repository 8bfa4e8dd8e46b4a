"""examples/llama: a torchtitan-style script (FSDP2/HSDP over `rt.device_mesh()`) under
TrainMover, run as real processes.

HSDP at DP=4 (2 replicas of 2 shards, one rank per machine): an uninterrupted run, and
one where a warm standby takes over m0 in a planned migration (its local shards and
AdamW state handed over one to one), then m1 is SIGKILLed while FSDP2's gradient
reduce-scatter is in flight: every survivor discards the step (FSDP2's per-iteration
state reset), and m1's joiner gets its shard from m3, the replica of the same shard.
With tensor parallelism (TP2) and pure FSDP at DP=2, a planned move hands over the
shards of DTensor-parallel weights, and a failure, with no replica, falls back to the
last checkpoint. With pipeline parallelism (PP2 x FSDP2, 1F1B), alone and in the 3-D
layout TP2 x PP2 x FSDP2 (4 machines of 2 ranks), a leaver in each stage and a failure in
a pipeline receive. Every run dumps every role's full state at the
last step; the moved runs must be bit-identical to the uninterrupted ones.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.test_ddp import (
    WAIT_S,
    Run,
    assert_bit_identical,
    assert_docs_show_the_diff,
    dp_roles,
)
from trainmover.examples.llama import train, train_trainmover
from trainmover.localjob import LocalJob
from trainmover.runtime.config import JobConfig

ENTRY = "trainmover.examples.llama.train_trainmover"
STEPS = 10
HSDP = JobConfig(
    job="llama-example",
    layout={"tp": 1, "pp": 1, "dp": 4, "dp_shard": 2},
    cluster={"machines": ["m0", "m1", "m2", "m3"]},
    model={"n_layers": 2},
    train={"steps": STEPS, "dump_steps": [STEPS]},
    runtime={"group_timeout_s": 60, "failure_timeout_s": 60},
)
PLANNED_AT = 3
FAULT = ("m1", 6, "dp-reduce-scatter")


def _reference(config: JobConfig, run_dir: Path) -> Run:
    with LocalJob.launch(config, run_dir, standbys=0, entry=ENTRY, timeout_s=WAIT_S) as job:
        job.finish(timeout_s=WAIT_S)
        return Run(run_dir, job.losses(), steps=config.train.steps)


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _reference(HSDP, tmp_path_factory.mktemp("llama-reference"))


@pytest.fixture(scope="module")
def hsdp_moved(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("llama-moved")
    machine, step, point = FAULT
    with LocalJob.launch(
        HSDP, run_dir, standbys=2, entry=ENTRY, timeout_s=WAIT_S, limit=2,
        extra_env={"TM_TEST_FAULT": f"{machine}@{step}:{point}"},
    ) as job:  # fmt: skip
        job.wait_step(2)
        warmed = job.warm(timeout_s=WAIT_S)  # shadow iterations of the user's FSDP2 model
        job.set_limit(PLANNED_AT)
        report = job.migrate({"m0": "s0"}, at_step=PLANNED_AT)
        assert report.commit_step == PLANNED_AT
        job.set_limit(STEPS)
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        recovery = job.recover(dead, detected_at=noticed, timeout_s=WAIT_S)
        job.finish(timeout_s=WAIT_S)
        return Run(run_dir, job.losses(), warmed, [recovery], steps=STEPS)


def test_a_moved_hsdp_job_ends_bit_identical_to_an_uninterrupted_one(hsdp_reference, hsdp_moved):
    assert_bit_identical(hsdp_moved, hsdp_reference, dp_roles(4))


def test_a_failed_shard_comes_from_the_replica_of_the_same_shard(hsdp_moved):
    assert hsdp_moved.recoveries is not None
    (recovery,) = hsdp_moved.recoveries
    assert recovery.dead == "m1" and recovery.step == FAULT[1] - 1
    assert recovery.plan.restore == "transfer" and recovery.plan.state_sources == {"m1": "m3"}


def test_the_standby_warmed_fsdp2_inside_the_sandbox(hsdp_moved):
    assert hsdp_moved.warmed is not None
    for warmed in hsdp_moved.warmed.values():
        assert warmed.error == "" and not warmed.store_known
        # FSDP2's all-gathers, reduce-scatters and HSDP's all-reduces, answered locally
        assert warmed.synthesized >= 2 * 3


def test_tp_with_pure_fsdp_moves_and_falls_back_to_the_checkpoint_bit_identically(
    tmp_path: Path,
) -> None:
    """TP2 x FSDP2: a planned move hands over local shards of DTensor-parallel weights;
    a failure has no replica (pure FSDP), so every rank reloads the last checkpoint."""
    config = HSDP.with_updates(
        layout={"tp": 2, "dp": 2, "dp_shard": 2},
        cluster={"machines": ["m0", "m1"]},
        runtime={"checkpoint_every": 2},
    )
    reference = _reference(config, tmp_path / "ref")
    with LocalJob.launch(
        config, tmp_path / "moved", standbys=2, entry=ENTRY, timeout_s=WAIT_S, limit=2,
        extra_env={"TM_TEST_FAULT": "m1@6:dp-reduce-scatter"},
    ) as job:  # fmt: skip
        job.wait_step(2)
        job.warm(timeout_s=WAIT_S)
        job.set_limit(PLANNED_AT)
        assert job.migrate({"m0": "s0"}, at_step=PLANNED_AT).commit_step == PLANNED_AT
        job.set_limit(STEPS)
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        recovery = job.recover(dead, detected_at=noticed, timeout_s=WAIT_S)
        assert recovery.plan.restore == "checkpoint"
        job.finish(timeout_s=WAIT_S)
        moved = Run(tmp_path / "moved", job.losses(), steps=STEPS)
    roles = [f"d{d}p0t{t}" for d in range(2) for t in range(2)]
    assert_bit_identical(moved, reference, roles)


def test_the_docs_show_exactly_the_examples_diff():
    assert_docs_show_the_diff(train, train_trainmover)


# -- pipeline parallelism ----------------------------------------------------------------

PP = HSDP.with_updates(
    layout={"tp": 1, "pp": 2, "dp": 2, "dp_shard": 2},
    runtime={"checkpoint_every": 2},
)
#: The 3-D layout of torchtitan's recipes, small: TP2 inside each machine (2 ranks), PP2
#: across machines, FSDP2 over the two pipelines; 4 machines, 8 ranks.
TP_PP_FSDP = PP.with_updates(layout={"tp": 2, "pp": 2, "dp": 2, "dp_shard": 2})
PP_FAULT = ("m2", 7, "pp-recv")


@pytest.mark.parametrize("config", [PP, TP_PP_FSDP], ids=["pp2-fsdp2", "tp2-pp2-fsdp2"])
def test_a_pipeline_with_a_leaver_in_each_stage_ends_bit_identical(
    config: JobConfig, tmp_path: Path
) -> None:
    """PP2 x FSDP2 (1F1B, two micro-batches), alone and under DTensor TP2: a planned move
    out of stage 0 (m0), then out of stage 1 (m3, the other pipeline); the joiner's fresh
    schedule and its stayers' redo the first-step handshake together. Then m2 dies in a
    pipeline receive: pure FSDP has no replica, so every rank reloads the last checkpoint
    and restarts its schedule."""
    reference = _reference(config, tmp_path / "ref")
    machine, step, point = PP_FAULT
    with LocalJob.launch(
        config, tmp_path / "moved", standbys=3, entry=ENTRY, timeout_s=WAIT_S, limit=2,
        extra_env={"TM_TEST_FAULT": f"{machine}@{step}:{point}"},
    ) as job:  # fmt: skip
        job.wait_step(2)
        warmed = job.warm(timeout_s=WAIT_S)  # the stage's shapes recorded at step 1
        job.set_limit(PLANNED_AT)
        assert job.migrate({"m0": "s0"}, at_step=PLANNED_AT).commit_step == PLANNED_AT
        job.set_limit(PLANNED_AT + 2)
        assert job.migrate({"m3": "s1"}, at_step=PLANNED_AT + 2).commit_step == PLANNED_AT + 2
        job.set_limit(STEPS)
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        recovery = job.recover(dead, detected_at=noticed, timeout_s=WAIT_S)
        assert dead == machine and recovery.plan.restore == "checkpoint"
        job.finish(timeout_s=WAIT_S)
        moved = Run(tmp_path / "moved", job.losses(), steps=STEPS)
    for answer in warmed.values():
        # The warm-up vote and the stage's activations and gradients, answered locally.
        assert answer.error == "" and answer.synthesized + answer.replayed >= 2
    lay = config.layout
    roles = [f"d{d}p{p}t{t}" for d in range(lay.dp) for p in range(lay.pp) for t in range(lay.tp)]
    assert_bit_identical(moved, reference, roles)


# -- the same script under plain torchrun ---------------------------------------------------


def _printed_losses(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("step ") and " loss " in line]


def test_the_torchrun_script_and_its_trainmover_version_train_alike(tmp_path: Path) -> None:
    """examples/llama/train.py under plain torchrun and train_trainmover.py under the
    runtime, with the same settings (the plain script's defaults) at PP2 x FSDP2: the
    losses each prints, step by step, are the same (the runtime changes no result)."""
    steps = 4
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         "-m", "trainmover.examples.llama.train", "--steps", str(steps), "--pp", "2",
         "--dp-shard", "2"],
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    defaults = train.Settings()
    config = PP.with_updates(
        model={
            "d_model": defaults.model.dim,
            "n_layers": defaults.model.n_layers,
            "n_heads": defaults.model.n_heads,
            "vocab_size": defaults.model.vocab_size,
            "mlp_ratio": defaults.model.ffn_dim // defaults.model.dim,
            "seq_len": defaults.model.seq_len,
        },
        train={
            "steps": steps,
            "dump_steps": [],
            "seed": defaults.seed,
            "lr": defaults.lr,
            "micro_batch_size": defaults.micro_batch_size,
        },
    )
    assert train_trainmover.settings_from_job(config) == train.Settings(
        steps=steps, pp=2, dp_shard=2
    )
    _reference(config, tmp_path / "tm")
    printed = "".join(p.read_text() for p in sorted((tmp_path / "tm" / "logs").glob("m*.log")))
    ours = _printed_losses(printed)
    assert len(ours) == steps  # one rank prints: the last stage of data-parallel index 0
    assert ours == _printed_losses(plain.stdout)
