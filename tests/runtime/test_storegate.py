"""The store gate with real c10d clients: the job's secret gets in, nothing else does."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from trainmover.runtime import storegate
from trainmover.runtime.rendezvous import RendezvousHost
from trainmover.runtime.storeclient import Store

SECRET = storegate.new_secret().encode()


@pytest.fixture
def gated():
    host = RendezvousHost("127.0.0.1", timeout_s=30, shards=1, secret=SECRET)
    yield host
    host.close()


def raw_client(address: str) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=3))


def test_a_raw_client_without_the_secret_cannot_write(gated: RendezvousHost) -> None:
    with pytest.raises(RuntimeError):
        client = raw_client(gated.address)
        client.set("e2e/commit/e0/40/decision", "abort")


def test_the_jobs_clients_pass_the_gate_and_its_shards_too(gated: RendezvousHost) -> None:
    for address in [gated.address, *gated.shards]:
        host, _, port = address.rpartition(":")
        storegate.register(host, int(port), SECRET)
    store = Store(gated.address, 10)
    store.set("job/k", b"v")
    assert store.get("job/k") == b"v"
    assert gated.keys() >= 2  # the role key and ours: the same server behind the gate
    shard = Store(gated.shards[0], 10)
    shard.set("job/s", b"1")
    assert shard.get("job/s") == b"1"


def test_a_wrong_secret_is_refused(gated: RendezvousHost) -> None:
    host, _, port = gated.address.rpartition(":")
    # A tunnel of this process to the same gate, with another secret.
    other = RendezvousHost("127.0.0.1", timeout_s=30, secret=SECRET)
    try:
        o_host, _, o_port = other.address.rpartition(":")
        storegate.register(o_host, int(o_port), b"x" * 64)
        at, to = storegate.local_end(o_host, int(o_port))
        with pytest.raises(RuntimeError):
            dist.TCPStore(at, to, is_master=False, timeout=timedelta(seconds=3)).set("k", "v")
    finally:
        other.close()
