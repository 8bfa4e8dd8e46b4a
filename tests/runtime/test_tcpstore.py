"""TCPStore servers and spare connections (`trainmover.runtime.tcpstore`), on real
TCPStores in this process."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from trainmover.runtime.tcpstore import SPARES, Spares, serve

pytestmark = pytest.mark.timeout(120)


def listening_tables(port: int) -> set[str]:
    """The /proc/net tables (tcp, tcp6) holding a listening socket on `port`."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(table)
    return found


def test_a_store_served_on_an_ipv4_host_listens_on_ipv4_only() -> None:
    """c10d alone listens dual-stack, where a local peer is the IPv4-mapped address, whose
    reverse lookup the hosts file cannot answer (the server's thread then waits on DNS)."""
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert listening_tables(plain.port) == {"tcp6"}  # what `serve` exists to avoid
    store = serve("127.0.0.1")
    assert listening_tables(store.port) == {"tcp"}
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_a_store_served_on_the_ipv6_loopback_listens_on_ipv6_only() -> None:
    try:
        store = serve("::1")
    except OSError as err:  # a host without IPv6
        pytest.skip(f"no IPv6 loopback here: {err}")
    assert listening_tables(store.port) == {"tcp6"}
    client = dist.TCPStore("::1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_spares_are_opened_ahead_and_each_take_is_a_client_of_its_own() -> None:
    store = serve("127.0.0.1")
    spares = Spares("127.0.0.1", store.port, connect_s=10.0)
    spares.fill()
    clients = [spares.take(30.0) for _ in range(SPARES + 3)]  # more than were kept
    assert len({id(c) for c in clients}) == len(clients)
    for i, client in enumerate(clients):
        client.add("n", 1)
        client.set(f"k{i}", str(i))
    assert store.add("n", 0) == len(clients)
    assert [store.get(f"k{i}") for i in range(len(clients))] == [
        str(i).encode() for i in range(len(clients))
    ]


def test_a_take_from_a_store_that_is_gone_names_it() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    spares = Spares("127.0.0.1", port, connect_s=0.5)
    with pytest.raises(dist.DistNetworkError, match=f"127.0.0.1:{port}"):
        spares.take(10.0)


def test_flushed_spares_of_a_restarted_store_reach_its_new_server() -> None:
    store = serve("127.0.0.1")
    port = store.port
    spares = Spares("127.0.0.1", port, connect_s=10.0)
    spares.take(30.0).set("before", "1")
    del store  # the server goes; its idle connections are dead
    again = serve("127.0.0.1", port)
    spares.flush()
    client = spares.take(30.0)
    client.set("after", "2")
    assert again.get("after") == b"2" and not again.check(["before"])


def test_spares_lost_with_their_server_are_ready_again_once_it_is_back() -> None:
    store = serve("127.0.0.1")
    port = store.port
    spares = Spares("127.0.0.1", port, connect_s=0.5, keep=3)
    spares.fill()
    spares.take(30.0).set("before", "1")
    del store
    spares.flush()  # the server is down: each spare keeps trying, beyond its connect_s
    with spares._cond:
        assert spares._ready == []
    again = serve("127.0.0.1", port)
    with spares._cond:
        assert spares._cond.wait_for(lambda: len(spares._ready) == 3, 30.0)
    client = spares.take(1.0)
    client.set("after", "2")
    assert again.get("after") == b"2"
