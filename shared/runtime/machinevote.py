"""The machine's half of the per-step commit vote: one voter per machine in the job's store.

The job's rendezvous store serves every machine of the job; with one voter per rank its
work per step grows with the ranks (each rank adds to the counter and waits for the
decision). So the ranks of one machine count their votes in a store of their own
(`MachineStore`, hosted by local rank 0), and only the last of them to arrive casts the
machine's vote in the job's store: a step commits once every machine voted, and a
machine votes only once all of its ranks did. Local rank 0 relays each decision it
watches in the job's store into the machine's store, where the other ranks watch it.
The job's store then sees one vote and one watcher per machine, whatever the ranks per
machine. (torchft's managers do the same for their replica groups.)

Local rank 0 serves the store as its process starts and names it in its hello; the
sidecar's welcome gives that address to every rank of the launch, a standby's too, so
each rank sets up its share while it waits for a role, and a failure's joiner opens no
connection to its machine's store on the way to its first step. Nothing here outlives
the launch: the machine's ranks leave, fail and are replaced together, and a relaunch is
a new launch with a store of its own.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from trainmover.runtime.storeclient import ABSENT
from trainmover.runtime.tcpstore import connect, serve

HOST = "127.0.0.1"
"""The machine's ranks share a host: the store listens on loopback."""


def client_of(address: str, timeout_s: float) -> dist.TCPStore:
    """A plain client of the machine's store at `address` (host:port)."""
    host, _, port = address.rpartition(":")
    return connect(host, int(port), timeout_s, gated=False)  # a machine's own: loopback


class MachineStore:
    """The store the ranks of one machine count their votes in (a TCPStore server on its
    own thread, in local rank 0's process)."""

    def __init__(self) -> None:
        self._server = serve(HOST)
        self.address = f"{HOST}:{self._server.port}"


class MachineTally:
    """One rank's use of its machine's store for the vote: `arrive` on the voting
    thread; `relay` (local rank 0) or `wait` (the others) on the watcher thread."""

    def __init__(
        self,
        address: str,
        local_rank: int,
        local_world: int,
        timeout_s: float,
        server: MachineStore | None = None,
    ):
        #: The machine's store (where the progress board folds its ranks' entries too).
        self.address = address
        self.local_world = local_world
        #: Local rank 0 watches the job's store and writes each decision here.
        self.relays = local_rank == 0

        self._voting = client_of(address, timeout_s)
        self._watching = client_of(address, timeout_s)
        #: The store itself, on local rank 0 (kept alive with this tally).
        self.server = server

    def arrive(self, step_key: str) -> bool:
        """This rank reached the vote of the step `step_key` names; True for the last of
        the machine's ranks (which then casts the machine's vote)."""
        return self._voting.add(f"{step_key}/arrived", 1) == self.local_world

    def forget(self, step_key: str) -> None:
        """Drops a step's keys (every rank of the machine has read its decision)."""
        for what in ("arrived", "decision"):
            self._voting.delete_key(f"{step_key}/{what}")

    def relay(self, step_key: str, decision: str) -> None:
        self._watching.set(f"{step_key}/decision", decision)

    def wait(self, step_key: str, timeout: timedelta) -> str:
        """The step's decision as relayed; raises RuntimeError when none came in time."""
        key = f"{step_key}/decision"
        self._watching.wait([key], timeout)
        # One request: a `get` would wait for the key again first.
        value = self._watching.compare_set(key, ABSENT, ABSENT).decode()
        if value == ABSENT:
            raise RuntimeError(f"{key} is gone")
        return value
