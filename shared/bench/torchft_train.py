"""torchft's training script for the downtime benchmark: one replica group of the same
model, data and optimizer, made fault tolerant by a torchft `Manager` per step.

    TORCHFT_LIGHTHOUSE=http://host:port python -m trainmover.bench.torchft_train \\
        --config job.json --run-dir DIR --replica I

A replica group is one process holding the whole model (all layers on one stage, TP 1)
that trains the DP share `--replica` of the job's global batch; the DP gradient average
goes through the Manager (quorum per step, healing of a restarted replica from a live
peer). It uses the Manager directly, not torchft 0.2.0's DDP wrapper (a survivor there
crashes on `assert fut._fut` after a peer's connection reset). Events go to DIR/events/.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainmover.bench.role import EventWriter, build_role, solo_group
from trainmover.runtime.config import load_config
from trainmover.runtime.layout import Role
from trainmover.runtime.train_step import pipeline_step


def main(argv: list[str] | None = None) -> int:
    from torchft import Manager, ProcessGroupGloo  # the optional `bench` extra

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--replica", type=int, required=True)
    args = parser.parse_args(argv)
    job = load_config(args.config)
    # The same model in one process: TP 1, PP 1, DP = the job's replicas.
    cfg = job.with_updates(
        layout={"tp": 1, "pp": 1, "dp": job.layout.dp}, cluster={"machines": [], "standbys": []}
    )
    torch.set_num_threads(cfg.runtime.threads)
    role = Role(dp=args.replica, pp=0, tp=0)
    tp, pp = solo_group("tp", "tp.solo"), solo_group("pp", "pp.solo")
    r = build_role(cfg, role, lambda: tp)
    events = EventWriter(args.run_dir / "events" / f"replica{args.replica}.jsonl",
                         replica=args.replica)  # fmt: skip
    events.write("start")

    def state_dict() -> dict[str, Any]:
        return {"model": r.model.state_dict(), "optim": r.optimizer.state_dict(),
                "data": r.data.state_dict()}  # fmt: skip

    def load_state_dict(state: dict[str, Any]) -> None:
        r.model.load_state_dict(state["model"])
        r.optimizer.load_state_dict(state["optim"])
        r.data.load_state_dict(state["data"])

    # The replica group's own store (torchft's Manager joins it as a client).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica{args.replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
    )
    events.write("loaded")
    try:
        while True:
            manager.start_quorum()
            r.optimizer.zero_grad(set_to_none=True)
            loss = pipeline_step(r.model, *r.data.next_batch(), cfg.train.micro_batches, pp,
                                 cfg.model.d_model)  # fmt: skip
            grads = [p.grad for p in r.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()  # averaged over the quorum's participants
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            committed = manager.should_commit()
            if committed:
                r.optimizer.step()
            events.write("step", step=manager.current_step(), committed=committed,
                         participants=manager.num_participants(), loss=loss)  # fmt: skip
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
