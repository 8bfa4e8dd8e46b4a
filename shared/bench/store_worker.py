"""One rank of `trainmover bench store`'s vote rounds: votes on `--steps` steps through
the rendezvous store and prints each vote's seconds as JSON.

    python -m trainmover.bench.store_worker ADDRESS RANK WORLD MODE STEPS

MODE `trainmover`: the runtime's own commit agreement (`CommitAgreement`: a counted
decision of the failover client, its watcher thread). MODE `tcpstore`: the same vote on a
bare TCPStore client, as the runtime made it before the store had replicas (one add, the
last voter's compare-and-set, a wait for the decision).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from trainmover.runtime.abort import AbortSignal
from trainmover.runtime.agreement import CommitAgreement

TIMEOUT_S = 120.0


def trainmover_votes(address: str, world: int, steps: int) -> list[float]:
    agreement = CommitAgreement(address, "bench", world, AbortSignal("e0"), 0, TIMEOUT_S)
    seconds = []
    for step in range(1, steps + 1):
        agreement.begin(step)
        started = time.perf_counter()
        agreement.vote(step)
        seconds.append(time.perf_counter() - started)
    agreement.close()
    return seconds


def tcpstore_votes(address: str, world: int, steps: int) -> list[float]:
    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    seconds = []
    for step in range(1, steps + 1):
        key = f"bench/commit/e0/{step}"
        started = time.perf_counter()
        if store.add(f"{key}/votes", 1) == world:
            store.compare_set(f"{key}/decision", "", "commit")
        store.wait([f"{key}/decision"], timedelta(seconds=TIMEOUT_S))
        if store.get(f"{key}/decision") != b"commit":
            raise RuntimeError(f"step {step} not committed")
        seconds.append(time.perf_counter() - started)
    return seconds


def main(argv: list[str]) -> int:
    address, _rank, world, mode, steps = argv
    run = trainmover_votes if mode == "trainmover" else tcpstore_votes
    print(json.dumps(run(address, int(world), int(steps))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
