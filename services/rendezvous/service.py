"""The rendezvous store and its HTTP endpoints (/healthz, /metrics).

The store lives as long as the service: groups and commit votes of a running job are in
it, so a restart ends the job's current groups (workers fail their next store operation,
as on a lost peer). Run one per job, on a machine that is never drained with the job.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

from trainmover.httpserver import HttpServer, serve_observability
from trainmover.logs import get_logger
from trainmover.metric_names import RENDEZVOUS_KEYS
from trainmover.metrics import Registry
from trainmover.runtime.rendezvous import RendezvousHost
from trainmover.service import write_port_file

log = get_logger("rendezvous")


class RendezvousService:
    """A TCPStore server on `--store-port`, observable over HTTP."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log_format, self.log_level = args.log_format, args.log_level
        self.metrics = Registry()
        self._keys = self.metrics.gauge(RENDEZVOUS_KEYS, "keys in the rendezvous store")
        self._host: RendezvousHost | None = None
        self._http: HttpServer | None = None
        self._started = time.time()

    async def start(self) -> None:
        a = self.args
        # Everywhere means this machine's name for the clients (informational: sidecars
        # are given the address by their deployment).
        advertise = socket.gethostname() if a.store_host in ("0.0.0.0", "::") else None
        host = await asyncio.to_thread(
            RendezvousHost, a.store_host, a.store_timeout, a.store_port, advertise
        )
        self._host = host
        self._http = await serve_observability(self.metrics, self.health, a.http_host, a.http_port)
        write_port_file(a.port_file, self._http.port)
        log.info("rendezvous_listening", store=host.address, http_port=self._http.port)

    def health(self) -> dict[str, object]:
        if self._host is None:
            return {"status": "starting"}
        try:
            keys = self._host.keys()
        except Exception as err:  # a store that cannot answer is not healthy
            return {"status": "error", "error": str(err)}
        self._keys.set(keys)
        return {
            "status": "ok",
            "store": self._host.address,
            "store_port": self._host.port,
            "keys": keys,
            "uptime_s": round(time.time() - self._started, 1),
        }

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
        if self._host is not None:
            self._host.close()
