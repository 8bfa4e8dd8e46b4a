"""The link limit of the state benchmark: raw gloo send/recv between two processes on
loopback, and the runtime's streamed transfer alone between the same two processes.

    python -m trainmover.bench.link_probe --rank R --port P --bytes N --repeats K

Rank 0 sends N bytes to rank 1, K times each way of sending, alternating: raw (one gloo
send of the whole buffer over one connection, as pieces of at most 1 GiB all posted at
once: no 32-bit size anywhere), then `trainmover.runtime.transfer` over the pair's
connections (`runtime.transfer_connections`) with its per-chunk checksums and without.
Rank 1 prints the seconds of each as one JSON line. Both buffers are written before the
first transfer, as a joiner's own parameters are. With no TrainMover service running
beside it, the streamed figures tell what the transfer code costs from what the rest of
a running system takes from the host.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainmover.runtime.build import build_group
from trainmover.runtime.config import RuntimeConfig
from trainmover.runtime.groups import Group
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.transfer import CHUNK_BYTES, receive_state, send_state

PIECE = 1 << 30
CPU = torch.device("cpu")
MEMBERS = [RankRef(machine="a", local_rank=0), RankRef(machine="b", local_rank=0)]


def _raw(group: Group, rank: int, buffer: torch.Tensor) -> None:
    pieces = [buffer[i : i + PIECE] for i in range(0, buffer.numel(), PIECE)]
    if rank == 0:
        for pending in [group.send(piece, 1) for piece in pieces]:
            pending.wait()
    else:
        for pending in [group.irecv(piece, 0) for piece in pieces]:
            pending.wait()


def _streamed(group: Group, rank: int, buffer: torch.Tensor, checksums: bool, chunk: int) -> None:
    tensors = {"state": buffer}
    if rank == 0:
        send_state(group, 1, {}, tensors, CPU, chunk_bytes=chunk, checksums=checksums)
    else:
        receive_state(group, 0, tensors, CPU)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainmover.bench.link_probe")
    p.add_argument("--rank", type=int, choices=(0, 1), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES)
    args = p.parse_args(argv)
    store = dist.TCPStore("127.0.0.1", args.port, 2, args.rank == 0, timedelta(seconds=300))
    spec = GroupSpec(name="transfer.probe", kind="transfer", generation=0, members=MEMBERS)
    # Raw gloo over the pair's first connection; the runtime's transfer over all of its
    # connections (its default), as in a migration.
    connections = RuntimeConfig().transfer_connections
    group = build_group(spec, MEMBERS[args.rank], store, "probe", CPU, 600, None, connections)
    buffer = torch.full((args.bytes,), args.rank + 1, dtype=torch.uint8)
    ways = {
        "seconds": lambda: _raw(group, args.rank, buffer),
        "streamed_seconds": lambda: _streamed(group, args.rank, buffer, True, args.chunk_bytes),
        "streamed_no_checksum_seconds": lambda: _streamed(
            group, args.rank, buffer, False, args.chunk_bytes
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, transfer in ways.items():
            group.barrier()
            started = time.perf_counter()
            transfer()
            seconds[name].append(time.perf_counter() - started)
    group.barrier()
    group.shutdown()
    if args.rank == 1:
        print(json.dumps({"bytes": args.bytes, **seconds}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
