"""The link limit of the state benchmark: raw gloo send/recv between two processes on
loopback, no TrainMover code.

    python -m trainmover.bench.link_probe --rank R --port P --bytes N --repeats K

Rank 0 sends N bytes to rank 1, K times; rank 1 prints the seconds of each receive as
one JSON line. The bytes go as pieces of at most 1 GiB, all posted at once (gloo's own
way to move a large buffer, without a 32-bit size anywhere); the receiving buffer is
written before the first receive, as a joiner's own parameters are.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PIECE = 1 << 30


def _pieces(buffer: torch.Tensor) -> list[torch.Tensor]:
    return [buffer[i : i + PIECE] for i in range(0, buffer.numel(), PIECE)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainmover.bench.link_probe")
    p.add_argument("--rank", type=int, choices=(0, 1), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    store = dist.TCPStore("127.0.0.1", args.port, 2, args.rank == 0, timedelta(seconds=300))
    # Any: the type stubs of ProcessGroupGloo lack send/recv/barrier.
    group: Any = dist.ProcessGroupGloo(store, args.rank, 2, timedelta(seconds=600))
    buffer = torch.ones(args.bytes, dtype=torch.uint8)
    seconds = []
    for _ in range(args.repeats):
        group.barrier().wait()
        started = time.perf_counter()
        if args.rank == 0:
            works = [group.send([piece], 1, 0) for piece in _pieces(buffer)]
        else:
            works = [group.recv([piece], 0, 0) for piece in _pieces(buffer)]
        for work in works:
            work.wait()
        seconds.append(time.perf_counter() - started)
    group.barrier().wait()
    if args.rank == 1:
        print(json.dumps({"bytes": args.bytes, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
