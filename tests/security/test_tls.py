"""TLS: a server started with the generated TLS block, and components that verify it
with the CA named in their credentials file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.security.conftest import FAST_BCRYPT
from trainmover import bus
from trainmover.natsserver import EmbeddedNats
from trainmover.security.authcli import generate
from trainmover.security.credentials import from_file
from trainmover.security.secrets import ClientTls
from trainmover.security.serverconf import ServerTls


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, signed by it."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=trainmover-test-ca",
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca.pem",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server-key.pem",
        "-out",
        "server.csr",
        cwd=d,
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca-key.pem",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
        "-out",
        "server.pem",
        cwd=d,
    )
    return d / "ca.pem", d / "server.pem", d / "server-key.pem"


async def test_components_connect_over_tls(tmp_path: Path) -> None:
    ca, cert, key = make_certs(tmp_path)
    store, _ = generate(
        tmp_path / "auth",
        {"jobT": ["m0"]},
        rounds=FAST_BCRYPT,
        client_tls=ClientTls(ca=str(ca)),
        server_tls=ServerTls(str(cert), str(key)),
    )
    assert "tls {" in (store.root / "nats-server.conf").read_text()
    server = EmbeddedNats(tmp_path / "js", config_file=store.root / "nats-server.conf").start()
    try:
        auth = from_file(store.creds_file("planner"))
        assert auth.tls and auth.tls_ca == str(ca)
        nc = await bus.connect(server.url, "planner", auth=auth, max_reconnect_attempts=0)
        assert nc.is_connected
        await bus.ensure_job(nc.jetstream(), "jobT")
        await nc.close()
        # Without the CA, the server's certificate is not trusted: no connection.
        untrusting = auth.merged(tls_ca=str(tmp_path / "server.pem"))
        with pytest.raises(bus.BusUnreachable):
            await bus.connect(server.url, "planner", auth=untrusting, max_reconnect_attempts=0)
    finally:
        server.cleanup()
