"""examples/llama with pipeline parallelism through the whole system, on the smallest
settings: PP2 x FSDP2, four machines of one rank and two standbys. Machines are numbered
data-parallel-major, so m0 and m2 hold stage 0, m1 and m3 stage 1.

The demo's three interruptions, run by the demo itself: a drain of m0 (a leaver in stage
0), a SIGKILL of m3 (a leaver in stage 1; pure FSDP keeps no replica of its shard, so the
job falls back to its last checkpoint and says so), and a straggler (m1). Then the same
script without interruptions, and the bit-exact comparison of every role's parameters
and optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import progress_reaches
from trainmover import demo, demo_examples
from trainmover.demo_examples import DemoJob

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]

PIPELINE = DemoJob(
    name="llama-pp",
    description="examples/llama at PP2 x FSDP2 on 4 machines + 2 standbys",
    entry="trainmover.examples.llama.train_trainmover",
    targets=("m0", "m3", "m1"),
    layout={"tp": 1, "pp": 2, "dp": 2, "dp_shard": 2},
    machines=["m0", "m1", "m2", "m3"],
    default_steps=2000,
    model={"n_layers": 2},
    runtime={"checkpoint_every": 5},
)


async def test_a_pipelined_llama_moves_a_leaver_of_each_stage_and_ends_bit_identical(
    tmp_path: Path,
) -> None:
    recovering: list[str] = []

    async def kill(cluster, machine):
        row = await demo.kill(cluster, machine)
        recovering.append((await progress_reaches(cluster, row.event_id, "recovering")).detail)
        return row

    scenarios = demo_examples.scenarios(PIPELINE, demo.drain, kill, demo.slow_down)
    report = await demo.run(PIPELINE.default_steps, tmp_path, scenarios, PIPELINE)
    drain, failure, straggler = report.migrations
    assert [m.state for m in report.migrations] == ["done"] * 3, [
        m.detail for m in report.migrations
    ]
    assert (drain.leaver, failure.leaver, straggler.leaver) == ("m0", "m3", "m1")
    assert recovering == ["every rank resumes; state from the last checkpoint"]
    assert report.bitexact and report.mismatches == []
