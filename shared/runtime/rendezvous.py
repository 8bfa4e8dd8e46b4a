"""The rendezvous store's host: one TCPStore server per job, in a process that does not
train (the rendezvous service, or `trainmover up` itself), never on a training machine
that could be migrated away. Any reachable TCPStore can take its place (workers are
given its address)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class RendezvousHost:
    """A TCPStore server, hosted by this (non-training) process: on an ephemeral port by
    default, or on `port` (the rendezvous service's). `address` is what workers dial;
    `host` "0.0.0.0" listens everywhere and `advertise` names this machine then."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 120.0,
        port: int = 0,
        advertise: str | None = None,
    ):
        self._store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        self.port = self._store.port
        self.address = f"{advertise or host}:{self.port}"

    def keys(self) -> int:
        """Keys in the store: a round trip through its server (a liveness check)."""
        return self._store.num_keys()

    def close(self) -> None:
        del self._store
