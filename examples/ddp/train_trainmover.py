"""The DDP script of `train.py` under TrainMover: only `main` changes.

Launched by the sidecar (``--entry trainmover.examples.ddp.train_trainmover``), one
process per rank of a data-parallel layout (tp=1, pp=1). docs/integration.md shows the
diff against `train.py`; tests/examples run exactly this file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch.distributed as dist

from trainmover.examples.ddp.train import Settings, build, train_step
from trainmover.runtime.config import JobConfig
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Role
from trainmover.runtime.worker import Runtime


def settings_from_job(config: JobConfig) -> Settings:
    """The script's settings from the job config, which leaver and joiner share."""
    t, m = config.train, config.model
    return Settings(
        steps=t.steps,
        seed=t.seed,
        lr=t.lr,
        width=m.d_model,
        depth=m.n_layers,
        micro_batches=t.micro_batches,
        micro_batch_size=t.micro_batch_size,
    )


def main() -> int:
    with Runtime.from_env() as rt:
        s = settings_from_job(rt.config)

        def shadow(role: Role, groups: GroupTable) -> Callable[[], float]:
            model, optimizer, data = build(s, rt.device)  # inside the sandbox
            return lambda: train_step(model, optimizer, data, s)

        if rt.wait_for_role(shadow=shadow) is None:
            return 0  # a standby released without being needed
        dist.init_process_group()
        model, optimizer, data = build(s, rt.device)
        rt.track(model, optimizer, stateful={"data": data})
        for step in rt.steps():
            with rt.attempt():
                loss = train_step(model, optimizer, data, s)
                rt.report(loss=loss)
            if dist.get_rank() == 0:
                print(f"step {step} loss {loss:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
