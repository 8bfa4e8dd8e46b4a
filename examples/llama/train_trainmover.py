"""The torchtitan-style script of `train.py` under TrainMover: only `main` changes.

Launched by the sidecar (``--entry trainmover.examples.llama.train_trainmover``), one
process per rank of the job config's layout; the mesh comes from the runtime
(`rt.device_mesh()`), whose dimension groups a migration replaces. docs/integration.md
shows the diff against `train.py`; tests/examples run exactly this file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch.distributed as dist

from trainmover.examples.llama.model import ModelArgs
from trainmover.examples.llama.train import Settings, build, train_step
from trainmover.runtime.config import JobConfig
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Role
from trainmover.runtime.worker import Runtime


def settings_from_job(config: JobConfig) -> Settings:
    """The script's settings from the job config, which leaver and joiner share."""
    t, m, lay = config.train, config.model, config.layout
    return Settings(
        steps=t.steps,
        seed=t.seed,
        lr=t.lr,
        model=ModelArgs(
            dim=m.d_model,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            vocab_size=m.vocab_size,
            ffn_dim=m.d_model * m.mlp_ratio,
            seq_len=m.seq_len,
        ),
        micro_batch_size=t.micro_batch_size,
        pp=lay.pp,
        dp_replicate=lay.dp_replicate,
        dp_shard=lay.dp_shard,
        tp=lay.tp,
    )


def main() -> int:
    with Runtime.from_env() as rt:
        s = settings_from_job(rt.config)

        def shadow(role: Role, groups: GroupTable) -> Callable[[], float | None]:
            t = build(s, rt.device_mesh(), rt.device)  # in the sandbox
            return lambda: train_step(t, s)

        if rt.wait_for_role(shadow=shadow) is None:
            return 0  # a standby released without being needed
        dist.init_process_group()
        t = build(s, rt.device_mesh(), rt.device)
        rt.track(t.model, t.optimizer, stateful={"data": t.data})
        for step in rt.steps():
            with rt.attempt():
                loss = train_step(t, s)
                rt.report(loss=loss)
            if t.reports_loss and loss is not None:
                print(f"step {step} loss {loss:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
