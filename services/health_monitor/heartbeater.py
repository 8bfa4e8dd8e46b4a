"""A stand-in sidecar that only publishes heartbeats, for the benchmark and tests.

    python -m trainmover.services.health_monitor.heartbeater --nats-url URL \\
        --job job1 --machine m0 [--machine m1 ...] [--interval 0.5]

Publishes one Heartbeat per machine every interval (all workers `running`), on the
subject a real sidecar uses, until killed. It prints `ready` once connected, so a
parent can wait for it without sleeping.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from trainmover import bus, logs
from trainmover.messages import Heartbeat, WorkerStatus
from trainmover.subjects import JobSubjects


async def run(url: str, job: str, machines: list[str], interval: float, workers: int) -> None:
    nc = await bus.connect(url, "heartbeater")
    subjects = JobSubjects(job)
    statuses = [
        WorkerStatus(local_rank=r, pid=os.getpid(), state="running") for r in range(workers)
    ]
    seq = 0
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while True:
        for machine in machines:
            hb = Heartbeat(job=job, machine=machine, seq=seq, status="active", workers=statuses)
            await nc.publish(subjects.heartbeat(machine), hb.to_json())
        await nc.flush()
        seq += 1
        # A fixed schedule, not sleep(interval) after work: the interval stays exact.
        next_at += interval
        await asyncio.sleep(max(next_at - loop.time(), 0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainmover.services.health_monitor.heartbeater")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--machine", action="append", required=True)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    logs.configure(level="warning", stream=sys.stderr)  # stdout carries the result
    try:
        asyncio.run(run(args.nats_url, args.job, args.machine, args.interval, args.workers))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
