"""Kills the serving replica of a two-replica rendezvous store under client load and
prints each client process's longest pause (issue 39's store-kill stall, isolated).

    .venv/bin/python tools/store_failover.py [PROCESSES] [THREADS]

Two rendezvous services (`trainmover service rendezvous --replicas ...`), PROCESSES
client processes with THREADS threads each looping `Store.set`/`Store.get`; once every
client runs, the serving replica is SIGKILLed and started again on its port at once (as
the chaos soak's store_kill does), and every process reports its worst gap between two
operations. A takeover costs about TAKEOVER_S (1 s); more is the stall.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

from trainmover.freeports import free_ports
from trainmover.runtime.storeclient import Store
from trainmover.runtime.storelook import SERVING, probe


def client(address: str, threads: int) -> None:
    """One client process: `threads` loops until stdin closes; prints its worst gap."""
    worst = [0.0] * threads
    stop = threading.Event()
    ready = threading.Barrier(threads + 1)

    def loop(t: int) -> None:
        store = Store(address, 30.0)
        store.set(f"k{t}", "0")
        ready.wait()
        last = time.monotonic()
        i = 0
        while not stop.is_set():
            store.set(f"k{t}", str(i))
            store.get(f"k{t}")
            now = time.monotonic()
            worst[t], last, i = max(worst[t], now - last), now, i + 1
            stop.wait(0.01)

    runs = [threading.Thread(target=loop, args=(t,)) for t in range(threads)]
    for run in runs:
        run.start()
    ready.wait()
    print("ready", flush=True)
    sys.stdin.readline()
    stop.set()
    for run in runs:
        run.join()
    print(json.dumps({"worst_s": round(max(worst), 3)}), flush=True)


def main(processes: int, threads: int) -> None:
    ports = free_ports(2)
    address = ",".join(f"127.0.0.1:{p}" for p in ports)

    def replica(i: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "trainmover.cli", "service", "rendezvous",
             "--store-host", "127.0.0.1", "--http-port", "0",
             "--replicas", address, "--replica-index", str(i)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    replicas = [replica(0), replica(1)]
    clients: list[subprocess.Popen[str]] = []
    try:
        Store(address, 60.0).num_keys()  # once one serves
        clients = [
            subprocess.Popen(
                [sys.executable, __file__, "--client", address, str(threads)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )  # fmt: skip
            for _ in range(processes)
        ]
        for c in clients:
            assert c.stdout is not None and c.stdout.readline().strip() == "ready"
        time.sleep(3)  # steady load before the kill
        serving = next(
            i for i, p in enumerate(ports) if (probe("127.0.0.1", p) or ("",))[0] == SERVING
        )
        replicas[serving].send_signal(signal.SIGKILL)
        replicas[serving].wait()
        replicas[serving] = replica(serving)
        time.sleep(10)  # the failover and the restarted replica's return
        gaps = sorted(
            json.loads(c.communicate("\n")[0].splitlines()[-1])["worst_s"] for c in clients
        )
        print(json.dumps({"killed": serving, "worst_s": gaps[-1], "median_s": gaps[len(gaps) // 2],
                          "per_process_s": gaps}))  # fmt: skip
    finally:
        for proc in [*clients, *replicas]:
            proc.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client(sys.argv[2], int(sys.argv[3]))
    else:
        main(
            int(sys.argv[1]) if len(sys.argv) > 1 else 12,
            int(sys.argv[2]) if len(sys.argv) > 2 else 4,
        )
