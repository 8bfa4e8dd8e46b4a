"""The job's rendezvous store in the embedded stack of `trainmover up`.

Hosted here, never on a training machine: one store in the stack's own process, or with
`replicas` N, N rendezvous service processes (one serving, the others standing by) on
ports fixed for the stack's life, so that a restarted one comes back where the sidecars
look for it; with `shards` S each hosts S stores of the commit vote on the ports after
its own. With a store secret (`--auth`) each store sits behind its gate and this
process's own clients of it are registered to pass it (`trainmover.runtime.storegate`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from trainmover.freeports import free_port_block, free_ports
from trainmover.ports import store_addresses
from trainmover.runtime import storegate
from trainmover.runtime.storegate import job_secret_file, read_secret, register

#: Name prefix of the store's replica processes ("rendezvous-0", ...).
REPLICA = "rendezvous-"


class StackStore:
    """Where the job's store runs and how to reach it (`address`)."""

    def __init__(self, host: str, replicas: int = 0, shards: int = 0) -> None:
        if replicas < 0:
            raise ValueError(f"--store-replicas {replicas}: not a number of replicas")
        if shards < 0:
            raise ValueError(f"--store-shards {shards}: not a number of shards")
        self.host, self.replicas, self.shards = host, replicas, shards
        self.replica_ports: list[int] = []
        self.address = ""
        #: The job's store secret, where the stack runs with --auth.
        self.secret_file: Path | None = None
        self._hosted: object | None = None
        self._registered: list[tuple[str, int]] = []

    def gate(self, auth_dir: Path, job: str) -> None:
        """Puts the store behind its gate, with `job`'s secret in `auth_dir`."""
        self.secret_file = job_secret_file(auth_dir, job)

    def _register(self, addresses: list[str]) -> bytes | None:
        if self.secret_file is None:
            return None
        secret = read_secret(self.secret_file)
        for address in addresses:
            for host, port in store_addresses(address):
                register(host, port, secret)
                self._registered.append((host, port))
        return secret

    @property
    def names(self) -> list[str]:
        """The replicas' process names."""
        return [f"{REPLICA}{i}" for i in range(self.replicas)]

    async def start(
        self, spawn: Callable[[str], Awaitable[None]], exit_code: Callable[[str], int | None]
    ) -> None:
        """Starts the store; with replicas, `spawn`s each and returns once one serves
        (RuntimeError naming a replica that exited meanwhile, by `exit_code`)."""
        if not self.replicas:
            from trainmover.runtime.rendezvous import RendezvousHost

            secret = self._register([])
            hosted = await asyncio.to_thread(
                RendezvousHost, self.host, shards=self.shards, secret=secret
            )
            self._register([hosted.address, *hosted.shards])
            self._hosted, self.address = hosted, hosted.address
            return
        from trainmover.runtime.storeclient import Store, StoreLost

        per = 1 + self.shards
        if self.shards:  # each replica's shards on the ports after its own
            base = free_port_block(per * self.replicas, self.host)
            self.replica_ports = [base + i * per for i in range(self.replicas)]
        else:
            self.replica_ports = free_ports(self.replicas, self.host)
        self.address = ",".join(f"{self.host}:{p}" for p in self.replica_ports)
        self._register([f"{self.host}:{p + i}" for p in self.replica_ports for i in range(per)])
        for name in self.names:
            await spawn(name)
        # Each takes a few seconds to import torch and look at the others.
        while True:
            try:
                await asyncio.to_thread(Store(self.address, 1.0).num_keys)
                return
            except StoreLost:
                for name in self.names:
                    code = exit_code(name)
                    if code is not None:
                        raise RuntimeError(
                            f"store replica {name} exited with code {code} while starting"
                        ) from None

    def replica_args(self, python: str, index: int) -> list[str]:
        """Replica `index`: a rendezvous service on its fixed port (it needs no bus and
        no credentials)."""
        secret = ["--store-secret-file", str(self.secret_file)] if self.secret_file else []
        return [
            python, "-m", "trainmover.cli", "service", "rendezvous",
            "--store-host", self.host, "--http-port", "0",
            "--replicas", self.address, "--replica-index", str(index),
            "--store-shards", str(self.shards), *secret,
        ]  # fmt: skip

    def serving_replica(self) -> tuple[str, str]:
        """The replica that serves now ("rendezvous-<i>") and its incarnation."""
        from trainmover.runtime.storelook import SERVING, probe

        for _ in range(3):  # a look can fail on a loaded host
            for i, port in enumerate(self.replica_ports):
                seen = probe(self.host, port)
                if seen is not None and seen[0] == SERVING:
                    return f"{REPLICA}{i}", seen[1]
        raise RuntimeError("no replica of the rendezvous store serves")

    def close(self) -> None:
        """Closes a store hosted here; this process forgets its clients' ways to it."""
        if self._hosted is not None:
            self._hosted.close()  # type: ignore[attr-defined]
            self._hosted = None
        if self.address:
            from trainmover.runtime import tcpstore  # torch: only where a store ran

            for host, port in store_addresses(self.address):
                tcpstore.forget(host, port)
        for host, port in self._registered:
            storegate.forget(host, port)
        self._registered.clear()
