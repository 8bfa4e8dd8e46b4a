"""The checkpoint-restart baseline of examples/llama under real torchrun: a job saved and
relaunched ends with the same parameters and optimizer state, bit for bit, as one that
never stopped, so `bench downtime --example llama` compares TrainMover with a baseline
that resumes correctly (PP2 x FSDP2 here: the pipeline's stages checkpoint apart)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainmover.bench.example_jobs import example_config
from trainmover.runtime.config import save_config
from trainmover.runtime.layout import Layout

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]

EVERY, STOP, END = 2, 2, 4


def _launch(config: Path, run_dir: Path, stop: int, launch: int) -> None:
    (run_dir / "stop_at").write_text(str(stop))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "trainmover.bench.llama_ckpt_train", "--config", str(config),
        "--run-dir", str(run_dir), "--every", str(EVERY), "--launch", str(launch),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]


def _saved(run_dir: Path, step: int, into: Path) -> dict[str, Any]:
    dcp_to_torch_save(run_dir / "ckpt" / f"step{step}", into)
    return torch.load(into, weights_only=False)


def _assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            _assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where


def test_a_relaunched_llama_job_resumes_bit_identically(tmp_path: Path) -> None:
    config = tmp_path / "job.json"
    save_config(example_config("llama", Layout.parse("1x2x2s2"), tiny=True), config)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    _launch(config, whole, END, 0)
    # A job killed after step STOP's checkpoint: only that one on disk, relaunched.
    shutil.copytree(whole / "ckpt" / f"step{STOP}", resumed / "ckpt" / f"step{STOP}")
    _launch(config, resumed, END, 1)

    ours = _saved(resumed, END, tmp_path / "resumed.pt")
    theirs = _saved(whole, END, tmp_path / "whole.pt")
    assert any(k.startswith("layers.") for k in ours["app"]["model"])
    assert ours["app"]["optim"]["state"], "the optimizer's moments were saved"
    _assert_same(ours, theirs)
    # Each rank's own file: the data position it resumed from and kept advancing.
    own = [torch.load(resumed / "ckpt" / f"step{END}" / f"rank{r}.pt") for r in range(4)]
    assert {o["step"] for o in own} == {END}
    assert {o["data"]["cursor"] for o in own} == {END * 2}  # micro_batch_size 2 per step
