"""`bench downtime --example`: the job it builds, what it refuses, and the wrapper's
step-time cost taken within each repetition (pure logic; the runs themselves are the
benchmark's, docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from trainmover.bench import ckpt_restart
from trainmover.bench.downtime_example import summarize
from trainmover.bench.example_jobs import EXAMPLES, example_config
from trainmover.bench.report import Result
from trainmover.examples.ddp.train_trainmover import settings_from_job
from trainmover.examples.llama.train_trainmover import settings_from_job as llama_settings
from trainmover.runtime.layout import Layout


def test_the_ddp_job_is_data_parallel_and_both_versions_read_the_same_settings() -> None:
    config = example_config("ddp", None, tiny=False)
    assert (config.layout.tp, config.layout.pp, config.layout.dp) == (1, 1, 2)
    assert config.cluster.machines == ["m0", "m1"]
    s = settings_from_job(config)  # what both the TrainMover and the torchrun side train
    assert s.width == EXAMPLES["ddp"].model["d_model"]
    assert s.micro_batch_size == EXAMPLES["ddp"].train["micro_batch_size"]
    assert example_config("ddp", Layout(tp=1, pp=1, dp=3), tiny=True).cluster.machines == [
        "m0",
        "m1",
        "m2",
    ]


def test_the_llama_job_is_tp_times_hsdp_and_both_versions_read_the_same_settings() -> None:
    config = example_config("llama", None, tiny=False)
    lay = config.layout
    assert (lay.tp, lay.pp, lay.dp_replicate, lay.dp_shard) == (2, 1, 2, 2)
    assert len(config.cluster.machines) == 4  # machines of TP ranks, one per DP index
    s = llama_settings(config)
    assert s.mesh_shape() == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert s.model.dim == EXAMPLES["llama"].model["d_model"]
    piped = llama_settings(example_config("llama", Layout.parse("1x2x2s2"), tiny=True))
    assert piped.mesh_shape() == {"pp": 2, "dp_shard": 2}


def test_a_layout_the_example_does_not_build_and_an_unknown_example_are_refused() -> None:
    with pytest.raises(ValueError, match=r"--layout 1x1xDP, not 2x1x2"):
        example_config("ddp", Layout(tp=2, pp=1, dp=2), tiny=True)
    with pytest.raises(ValueError, match=r"llama shards its state .* not 2x1x2 "):
        example_config("llama", Layout(tp=2, pp=1, dp=2), tiny=True)
    with pytest.raises(ValueError, match=r"no example 'fsdp9': one of ddp, llama"):
        example_config("fsdp9", None, tiny=True)


def _row(step_s: float) -> dict:
    return {"downtime_s": 0.1, "normal_step_s": step_s, "phases_s": {}, "group_build_s": 0.0,
            "groups_rebuilt": 1, "recomputed_steps": 1, "end_to_end_s": 0.1,
            "lost_in_flight_s": 0.0, "memory_mib": {}}  # fmt: skip


def test_the_step_overhead_is_taken_within_each_repetition() -> None:
    # Repetition 2 ran on a box twice as loaded: both systems slowed alike.
    rows = {
        "trainmover.planned": [_row(1.02), _row(2.04)],
        "trainmover.failure": [_row(1.02), "failed: WorkerDied"],
        "checkpoint_restart.failure": [_row(1.0), _row(2.0)],
        "checkpoint_restart.planned": [_row(1.0), _row(2.0)],
    }
    result = Result("downtime", example="ddp")
    summarize(result, rows)
    assert result.get("step_time.overhead_stats")["samples"] == pytest.approx([0.02, 0.02])
    assert result.get("step_time.overhead") == pytest.approx(0.02)
    assert result.get("step_time.trainmover_stats")["samples"] == [1.02, 2.04]
    assert result.get("step_cpu.overhead") is None  # not measured in these rows


def test_the_cpu_overhead_is_taken_within_each_repetition() -> None:
    rows = {
        "step_cpu.trainmover": [2.1, None, 4.4],  # repetition 2's window was not read
        "step_cpu.torchrun": [2.0, 2.0, 4.0],
    }
    result = Result("downtime", example="llama")
    summarize(result, rows)
    assert result.get("step_cpu.overhead_stats")["samples"] == pytest.approx([0.05, 0.1])
    assert result.get("step_cpu.torchrun_s") == 2.0


def test_a_save_and_restart_stops_a_second_of_steps_ahead_of_the_furthest_rank() -> None:
    fast = {s: 100.0 + 0.03 * s for s in range(1, 41)}  # 33 steps a second
    slow = {s: 100.0 + 2.0 * s for s in range(1, 41)}
    assert ckpt_restart.stop_ahead(fast) == 40 + 34
    assert ckpt_restart.stop_ahead(slow) == 40 + 3
