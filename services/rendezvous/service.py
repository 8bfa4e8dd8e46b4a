"""One replica of the rendezvous store and its HTTP endpoints (/healthz, /metrics).

Alone (no `--replicas`), the store lives as long as the service, and a restart costs
the job a pause until it is back (the ranks re-cast their share of the store into the
new one; their groups are untouched). With replicas, a standby takes over instead.
A replica that steps down for an earlier one (a healed partition) stops; its supervisor
starts it again as a standby.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import time

from trainmover.httpserver import HttpServer, serve_observability
from trainmover.logs import get_logger
from trainmover.metric_names import RENDEZVOUS_KEYS, RENDEZVOUS_SERVING
from trainmover.metrics import Registry
from trainmover.ports import store_addresses
from trainmover.runtime.rendezvous import RendezvousHost
from trainmover.runtime.storegate import register
from trainmover.service import write_port_file
from trainmover.tasks import until_set

log = get_logger("rendezvous")


class RendezvousService:
    """A TCPStore server on `--store-port`, observable over HTTP."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log_format, self.log_level = args.log_format, args.log_level
        self.metrics = Registry()
        self._keys = self.metrics.gauge(RENDEZVOUS_KEYS, "keys in the rendezvous store")
        self._serving = self.metrics.gauge(RENDEZVOUS_SERVING, "1 while this replica serves")
        self._watch: asyncio.Task[None] | None = None
        self._host: RendezvousHost | None = None
        self._http: HttpServer | None = None
        self._started = time.time()

    async def start(self) -> None:
        a = self.args
        # Everywhere means this machine's name for the clients (informational: sidecars
        # are given the address by their deployment).
        advertise = socket.gethostname() if a.store_host in ("0.0.0.0", "::") else None
        if a.store_secret is not None:
            # Its looks at the other replicas (and their shards) pass their gates.
            for peer, port in (store_addresses(p)[0] for p in a.peers):
                for at in range(port, port + 1 + a.store_shards):
                    register(peer, at, a.store_secret)
        host = await asyncio.to_thread(
            lambda: RendezvousHost(
                a.store_host,
                a.store_timeout,
                a.store_port,
                advertise,
                a.peers,
                a.replica_index,
                a.store_shards,
                secret=a.store_secret,
            )
        )
        self._host = host
        self._http = await serve_observability(self.metrics, self.health, a.http_host, a.http_port)
        write_port_file(a.port_file, self._http.port)
        log.info(
            "rendezvous_listening",
            store=host.address,
            http_port=self._http.port,
            role=host.role,
            incarnation=host.incarnation,
            replicas=len(a.peers) + 1,
            shards=host.shards,
        )
        if a.peers:
            self._watch = asyncio.create_task(self._follow(host))

    async def _follow(self, host: RendezvousHost) -> None:
        """Logs the replica's promotion; stops the service when it steps down."""
        if host.role != "serving":
            await until_set(host.promoted)
            log.warning("rendezvous_promoted", store=host.address, incarnation=host.incarnation)
        await until_set(host.demoted)
        log.error("rendezvous_demoted", store=host.address, reason="an earlier replica serves")
        os.kill(os.getpid(), signal.SIGTERM)

    def health(self) -> dict[str, object]:
        if self._host is None:
            return {"status": "starting"}
        try:
            keys = self._host.keys()
        except Exception as err:  # a store that cannot answer is not healthy
            return {"status": "error", "error": str(err)}
        self._keys.set(keys)
        self._serving.set(1 if self._host.role == "serving" else 0)
        return {
            "status": "ok",
            "role": self._host.role,
            "incarnation": self._host.incarnation,
            "store": self._host.address,
            "store_port": self._host.port,
            "shards": self._host.shards,
            "keys": keys,
            "uptime_s": round(time.time() - self._started, 1),
        }

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._http is not None:
            await self._http.stop()
        if self._host is not None:
            self._host.close()
