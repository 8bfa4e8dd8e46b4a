"""The embedded nats-server: free ports, readiness, clean stop."""

from __future__ import annotations

from trainmover.natsserver import EmbeddedNats, port_open, resolve_url


def test_two_servers_get_distinct_ports_and_stop_cleanly():
    with EmbeddedNats() as a, EmbeddedNats() as b:
        assert a.port != b.port
        assert port_open("127.0.0.1", a.port) and port_open("127.0.0.1", b.port)
        port, store = a.port, a.store_dir
    assert not port_open("127.0.0.1", port)
    assert not store.exists()


def test_url_from_environment(monkeypatch):
    monkeypatch.setenv("TRAINMOVER_NATS_URL", "nats://10.0.0.1:4222")
    assert resolve_url(None) == "nats://10.0.0.1:4222"
    assert resolve_url("nats://h:1") == "nats://h:1"
