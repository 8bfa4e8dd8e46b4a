"""A group member in its own network namespace, driven line by line over stdin/stdout.

Started by tests/netns under `ip netns exec`, with GLOO_SOCKET_IFNAME naming the
namespace's veth. Each stdin line is a JSON command; each answer is one JSON line:

    {"op": "join", "members": ["a", "b"], "generation": 0}   build the "dp" group
    {"op": "allreduce", "value": 1.0}                        sum over the group
    {"op": "reset", "epoch": "e1"}                           a recovery's new epoch
    {"op": "exit"}

Errors come back as {"ok": false, "type": ..., "error": ..., "s": seconds}. The group is
the runtime's own (trainmover.runtime.groups: store claims per generation, waits bounded
by the rank's AbortSignal), so what the test sees is what a worker would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainmover.runtime.abort import AbortSignal
from trainmover.runtime.build import build_group
from trainmover.runtime.groups import Group
from trainmover.runtime.plan import GroupSpec, RankRef


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--store", required=True, help="host:port of the rendezvous store")
    p.add_argument("--failure-timeout", type=float, required=True)
    p.add_argument("--group-timeout", type=float, required=True)
    args = p.parse_args()
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    me = RankRef(machine=args.name, local_rank=0)
    signal = AbortSignal("e0", args.failure_timeout)
    groups: list[Group] = []
    print(json.dumps({"ok": True, "ready": args.name}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        started = time.monotonic()
        try:
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "join":
                spec = GroupSpec(
                    name="dp",
                    kind="dp",
                    generation=cmd["generation"],
                    members=[RankRef(machine=m, local_rank=0) for m in cmd["members"]],
                )
                group = build_group(
                    spec, me, store, "netns", torch.device("cpu"), args.group_timeout, signal
                )
                groups.append(group)
                reply: dict[str, object] = {"rank": group.rank, "generation": group.generation}
            elif cmd["op"] == "allreduce":
                tensor = torch.tensor([float(cmd["value"])])
                groups[-1].allreduce(tensor)
                reply = {"sum": tensor.item()}
            elif cmd["op"] == "reset":
                for old in groups:
                    old.shutdown()  # never blocks, even with an abandoned work in it
                signal.reset(cmd["epoch"])
                reply = {}
            else:
                raise ValueError(f"unknown op {cmd['op']!r}")
            out = {"ok": True, **reply}
        except Exception as err:
            out = {"ok": False, "type": type(err).__name__, "error": str(err)[:300]}
        out["s"] = round(time.monotonic() - started, 3)
        print(json.dumps(out), flush=True)
    for group in groups:
        group.shutdown()
    # An abandoned gloo work may still hold a thread; nothing is left to flush or save.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
