"""The benchmarked job: the reference 3D-parallel job at benchmark sizes, and the command
line options every sub-command shares to change it.

Default: TP2 x PP2 x DP2 on 4 machines of 2 ranks, with a model large enough that a step
takes a few tenths of a second on these 2 shared cores (so downtime is not lost in the
step-time noise, and a step is long next to the control-plane round trips).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainmover.runtime.config import JobConfig, load_config
from trainmover.runtime.layout import Layout

#: Model and training sizes of the benchmark job (everything else: JobConfig defaults).
BENCH_MODEL = {"vocab_size": 128, "d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 32}
BENCH_TRAIN = {"micro_batches": 2, "micro_batch_size": 8, "steps": 1_000_000, "dump_steps": []}
#: The smoke test's job: same layout shape, a tiny model.
TINY_MODEL = {"vocab_size": 64, "d_model": 32, "n_heads": 4, "n_layers": 2, "seq_len": 16}
#: Waits of a compiled job (its collectives and the harnesses'). A rank's first compiled
#: iteration (inductor generating and gcc building its kernels) took minutes on 2 cores
#: at load 40-80, while its pipeline peer waited in a recv: at the default 120 s the
#: peer gave the step up and the job stopped at step 1.
COMPILE_TIMEOUT_S = 1800.0
EAGER_TIMEOUT_S = 600.0


def harness_timeout_s(config: JobConfig) -> float:
    """How long a benchmark harness waits for one thing of `config`'s job."""
    return COMPILE_TIMEOUT_S if config.train.compile else EAGER_TIMEOUT_S


def parse_layout(text: str) -> Layout:
    """'2x2x2' -> Layout(tp=2, pp=2, dp=2) (TP x PP x DP)."""
    try:
        return Layout.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


DEFAULT_LAYOUT = Layout(tp=2, pp=2, dp=2)


def bench_config(
    layout: Layout = DEFAULT_LAYOUT,
    compile: bool = False,
    tiny: bool = False,
    base: JobConfig | None = None,
) -> JobConfig:
    """The benchmark's job config. Steps are open-ended: a benchmark ends its job with
    limits, never by running out of steps."""
    config = base or JobConfig(job="bench", layout=layout)
    model = TINY_MODEL if tiny else BENCH_MODEL
    if base is not None:
        model = {}  # a user's config keeps its own model
    runtime = {"group_timeout_s": COMPILE_TIMEOUT_S, "failure_timeout_s": COMPILE_TIMEOUT_S}
    return config.with_updates(
        layout=layout.model_dump(),
        model=model,
        train={**BENCH_TRAIN, "compile": compile},
        runtime=runtime if compile else {},
    )


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", type=Path, required=True, help="result file (.md and .png beside it)"
    )
    parser.add_argument(
        "--layout",
        type=parse_layout,
        help="TPxPPxDP[sS] (default 2x2x2: 4 machines of 2 ranks; --example ddp: 1x1x2, llama: 2x1x4s2)",
    )
    parser.add_argument(
        "--config", type=Path, help="job config (YAML/JSON) instead of the bench model"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--tiny", action="store_true", help="tiny model (smoke runs)")
    parser.add_argument("--run-dir", type=Path, help="logs, checkpoints (default: a temp dir)")


def config_from_args(args: argparse.Namespace) -> JobConfig:
    base = load_config(args.config) if args.config else None
    return bench_config(args.layout or DEFAULT_LAYOUT, args.compile, args.tiny, base)
