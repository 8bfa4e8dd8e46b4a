"""The job's live status page in a process of its own, as `trainmover up` serves it: the
benchmark times its answers and reads its CPU apart from everything else.

    python -m trainmover.bench.pagehost --nats-url URL --job JOB

Prints one JSON line `{"port": P}` once it serves, and runs until its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from trainmover import bus, logs
from trainmover.statuspage import StatusPage


async def _serve(url: str, job: str) -> None:
    nc = await bus.connect(url, "status-page")
    page = StatusPage(nc, job)
    await page.start("127.0.0.1", 0)
    print(json.dumps({"port": page.port}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        await reader.read()  # until the parent closes it (or dies)
    finally:
        await page.stop()
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainmover.bench.pagehost")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--job", required=True)
    args = p.parse_args(argv)
    logs.configure(level="warning", stream=sys.stderr)  # stdout carries the port
    asyncio.run(_serve(args.nats_url, args.job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
