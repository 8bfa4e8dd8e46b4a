"""One process of `trainmover bench store`: a rank that votes on `--steps` steps through
the rendezvous store (or beats on the progress board, or plays voters to calibrate the
store) and prints each vote's start and end as JSON.

    python -m trainmover.bench.store_worker ADDRESS RANK WORLD MODE STEPS [MACHINE LOCAL | CLIENTS]

MODE `trainmover`: the runtime's own commit agreement (`CommitAgreement`: a counted
decision of the failover client, its watcher thread), every rank a voter in the job's
store (MODE `sharded`: the same on a store with shards, `trainmover.runtime.shardvote`).
MODE `machines`: the same agreement with one voter per machine: the rank counts
its vote in its machine's store (address MACHINE) with the machine's other LOCAL ranks
(`trainmover.runtime.machinevote`). MODE `tcpstore`: the flat vote on a bare TCPStore
client, as the runtime made it before the store had replicas (one add, the last voter's
compare-and-set, a wait for the decision). MODE `board`: the rank's progress-board
beacon for STEPS seconds, folded into its machine's store when MACHINE is given; it
prints the span in which it beat. MODE `calibrate`: one process plays WORLD
voters' requests to the job's store (`calibrate_votes`; RANK tags its keys, and the
last argument counts the clients that start together).

    python -m trainmover.bench.store_worker host job[:SHARDS]|MACHINES

hosts the job's store (a rendezvous replica, with SHARDS shards), or MACHINES machine stores (as their
sidecars would), prints the address(es) as JSON, keeps them until its stdin closes, then
prints its CPU time sampled meanwhile: what the stores' serving cost, apart from the
voters' and the bench's own processes, over any window of the votes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainmover.runtime.abort import AbortSignal
from trainmover.runtime.agreement import CommitAgreement
from trainmover.runtime.machinevote import MachineStore, MachineTally
from trainmover.runtime.progress import ProgressBoard
from trainmover.runtime.rendezvous import RendezvousHost
from trainmover.runtime.storeclient import ABSENT

TIMEOUT_S = 120.0
#: How often a store host samples its CPU time.
SAMPLE_S = 0.005


Span = tuple[float, float]
"""A vote's start and end (`time.monotonic`: one clock for every process of the host)."""


def trainmover_votes(
    address: str, world: int, steps: int, rank: int, machine: MachineTally | None = None
) -> list[Span]:
    agreement = CommitAgreement(
        address, "bench", world, AbortSignal("e0"), 0, TIMEOUT_S, machine=machine, rank=rank
    )
    spans = []
    for step in range(1, steps + 1):
        agreement.begin(step)
        started = time.monotonic()
        agreement.vote(step)
        spans.append((started, time.monotonic()))
    agreement.close()
    return spans


def _bare_client(address: str) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=TIMEOUT_S))


def tcpstore_votes(address: str, world: int, steps: int) -> list[Span]:
    store = _bare_client(address)
    spans = []
    for step in range(1, steps + 1):
        key = f"bench/commit/e0/{step}"
        started = time.monotonic()
        if store.add(f"{key}/votes", 1) == world:
            store.compare_set(f"{key}/decision", "", "commit")
        store.wait([f"{key}/decision"], timedelta(seconds=TIMEOUT_S))
        if store.get(f"{key}/decision") != b"commit":
            raise RuntimeError(f"step {step} not committed")
        spans.append((started, time.monotonic()))
    return spans


def calibrate_votes(address: str, voters: int, steps: int, tag: str, clients: int) -> list[Span]:
    """The job store's side of `voters` voters, played by one client (keys under `tag`):
    per step each voter's add, then the decision, then each voter's wait and read.
    Several such clients at once keep the store busy, as a large job does: its CPU per
    step and voter is then the store's cost of a voter, apart from the contention of many
    processes on a small host and from waking an idle server for each request.

    A client plays rounds of `steps` steps until every client has played one: the last
    one to start (a process is scheduled when the host lets it) still plays beside the
    others, so the clients' spans always overlap."""
    store = _bare_client(address)
    # The clients start together (each one's process starts when it will).
    if store.add("bench/calibrate/ready", 1) == clients:
        store.set("bench/calibrate/go", "1")
    store.wait(["bench/calibrate/go"], timedelta(seconds=TIMEOUT_S))
    spans: list[Span] = []
    played_once = False
    while True:
        for _ in range(steps):
            key = f"bench/calibrate/{tag}/{len(spans)}"
            started = time.monotonic()
            for _ in range(voters):
                store.add(f"{key}/votes", 1)
            store.compare_set(f"{key}/decision", "", "commit")
            for _ in range(voters):
                store.wait([f"{key}/decision"], timedelta(seconds=TIMEOUT_S))
                store.compare_set(f"{key}/decision", ABSENT, ABSENT)
            spans.append((started, time.monotonic()))
        # One request per round, not per step: little beside the voters' own requests.
        done = store.add("bench/calibrate/done", 0 if played_once else 1)
        played_once = True
        if done >= clients:
            return spans


def board_beats(address: str, rank: int, world: int, seconds: float, machine: list[str]) -> Span:
    """This rank's progress-board beacon for `seconds` (folded into its machine's store
    when `machine` names one); the span in which it beat steadily."""
    local = int(machine[1]) if machine else 1
    board = ProgressBoard(
        address,
        "bench",
        rank,
        world,
        f"m{rank // local}",
        rank % local,
        machine_store=machine[0] if machine else None,
        local_world=local,
    )
    time.sleep(2 * board.interval_s)  # every rank's first beats out
    started = time.monotonic()
    time.sleep(seconds)
    span = (started, time.monotonic())
    board.close()
    return span


def host(what: str) -> None:
    if what.startswith("job"):
        _, _, shards = what.partition(":")
        stores: list[Any] = [RendezvousHost(shards=int(shards or 0))]
        addresses: str | list[str] = stores[0].address
    else:
        stores = [MachineStore() for _ in range(int(what))]
        addresses = [s.address for s in stores]
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            # The process's CPU clock: every thread, to the nanosecond (getrusage's
            # user/system split is scaled from scheduler ticks).
            samples.append((time.monotonic(), time.process_time()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    print(json.dumps(addresses), flush=True)
    sys.stdin.read()
    done.set()
    sampler.join()
    print(json.dumps(samples), flush=True)


def main(argv: list[str]) -> int:
    if argv[0] == "host":
        host(argv[1])
        return 0
    address, rank, world, mode, steps, *machine = argv
    if mode == "board":
        spans = [board_beats(address, int(rank), int(world), float(steps), machine)]
    elif mode == "machines":
        machine_address, local = machine
        local_rank = int(rank) % int(local)
        tally = MachineTally(machine_address, local_rank, int(local), TIMEOUT_S)
        spans = trainmover_votes(address, int(world), int(steps), int(rank), tally)
    elif mode == "calibrate":
        spans = calibrate_votes(address, int(world), int(steps), rank, int(machine[0]))
    elif mode in ("trainmover", "sharded"):  # the store names its shards, or none
        spans = trainmover_votes(address, int(world), int(steps), int(rank))
    else:
        spans = tcpstore_votes(address, int(world), int(steps))
    print(json.dumps(spans), flush=True)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except Exception:
        traceback.print_exc()
        code = 1
    # As a worker does: no interpreter teardown while the vote's watcher thread may be
    # inside a store wait (torn down under it, the thread can end the process with
    # SIGABRT, hiding the error).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
