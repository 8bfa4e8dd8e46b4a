"""The examples/ jobs the benchmarks can run: for each, its TrainMover version (the
worker entry the sidecar launches), its torchrun version with checkpoints (for
checkpoint-restart), and the sizes of the job both train.
"""

from __future__ import annotations

from collections.abc import Callable
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
    #: The layout unless --layout says otherwise.
    layout: Layout = Layout(tp=1, pp=1, dp=2)
    #: Why a layout cannot run this example (None: it can).
    refuse: Callable[[Layout], str | None] = lambda _: None


def _data_parallel_only(layout: Layout) -> str | None:
    if layout.tp == 1 and layout.pp == 1:
        return None
    return f"is data-parallel only: --layout 1x1xDP, not {layout.label}"


def _sharded_when_replicated(layout: Layout) -> str | None:
    """The llama script makes its replicated data parallelism HSDP (`train.build`)."""
    if layout.dp > 1 and layout.dp_shard == 1:
        return (
            f"shards its state over the DP ranks: --layout TPxPPxDPsS with S > 1, "
            f"not {layout.label} (e.g. 2x1x4s2: TP2 x HSDP 2x2)"
        )
    return None


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
        refuse=_data_parallel_only,
    ),
    # The Llama decoder with FSDP2 (HSDP), DTensor TP and, with PP in the layout,
    # torch.distributed.pipelining; by default the demo's TP2 x HSDP(2x2) on 4 machines
    # of 2 ranks, where a failed machine's shards come from its replica.
    "llama": BenchExample(
        entry="trainmover.examples.llama.train_trainmover",
        script="trainmover.bench.llama_ckpt_train",
        model={"d_model": 64, "n_layers": 4, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
        train={"micro_batch_size": 4},
        tiny_model={"d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
        tiny_train={"micro_batch_size": 2},
        layout=Layout(tp=2, pp=1, dp=4, dp_shard=2),
        refuse=_sharded_when_replicated,
    ),
}


def example_config(name: str, layout: Layout | None, tiny: bool) -> JobConfig:
    """The job both systems train for example `name` (a clear error for an unknown one,
    or a layout the example does not build)."""
    if name not in EXAMPLES:
        raise ValueError(f"no example {name!r}: one of {', '.join(sorted(EXAMPLES))}")
    ex = EXAMPLES[name]
    layout = layout or ex.layout
    why = ex.refuse(layout)
    if why is not None:
        raise ValueError(f"--example {name} {why}")
    base = bench_config(layout, tiny=tiny)
    return base.with_updates(
        model=ex.tiny_model if tiny else ex.model, train=ex.tiny_train if tiny else ex.train
    )
