"""The examples/ jobs the benchmarks can run: for each, its TrainMover version (the
worker entry the sidecar launches), its torchrun version with checkpoints (for
checkpoint-restart), and the sizes of the job both train.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmover.bench.settings import bench_config
from trainmover.runtime.config import JobConfig
from trainmover.runtime.layout import Layout


@dataclass(frozen=True)
class BenchExample:
    """An example's two launches and the job both train."""

    entry: str  # the TrainMover version, launched by the sidecar
    script: str  # the torchrun version with its checkpoints (ckpt_train's interface)
    model: dict[str, int] = field(default_factory=dict)
    train: dict[str, int] = field(default_factory=dict)
    tiny_model: dict[str, int] = field(default_factory=dict)
    tiny_train: dict[str, int] = field(default_factory=dict)


EXAMPLES: dict[str, BenchExample] = {
    # An MLP of 4.7 M parameters (57 MB of role state with AdamW): a step of about 0.1 s
    # of one core here, like the reference benchmark's, so a per-step cost shows next to
    # the step-time noise.
    "ddp": BenchExample(
        entry="trainmover.examples.ddp.train_trainmover",
        script="trainmover.bench.ddp_ckpt_train",
        model={"d_model": 384, "n_layers": 4},
        train={"micro_batches": 2, "micro_batch_size": 64},
        tiny_model={"d_model": 32, "n_layers": 2},
        tiny_train={"micro_batches": 2, "micro_batch_size": 4},
    ),
}

#: A data-parallel example's layout unless --layout says otherwise.
EXAMPLE_LAYOUT = Layout(tp=1, pp=1, dp=2)


def example_config(name: str, layout: Layout | None, tiny: bool) -> JobConfig:
    """The job both systems train for example `name` (a clear error for an unknown one,
    or a layout the example does not build)."""
    if name not in EXAMPLES:
        raise ValueError(f"no example {name!r}: one of {', '.join(sorted(EXAMPLES))}")
    ex = EXAMPLES[name]
    layout = layout or EXAMPLE_LAYOUT
    if layout.tp != 1 or layout.pp != 1:
        raise ValueError(
            f"--example {name} is data-parallel only: --layout 1x1xDP, not "
            f"{layout.tp}x{layout.pp}x{layout.dp}"
        )
    base = bench_config(layout, tiny=tiny)
    return base.with_updates(
        model=ex.tiny_model if tiny else ex.model, train=ex.tiny_train if tiny else ex.train
    )
