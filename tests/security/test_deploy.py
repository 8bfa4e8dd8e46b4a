"""deploy/nats/: the committed cluster configs are exactly what the generator makes from
deploy/nats/cluster.yaml, nats-server accepts them, and their password variables work."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.security.conftest import FAST_BCRYPT
from trainmover import bus
from trainmover.natsserver import EmbeddedNats, server_binary
from trainmover.security.authcli import PASSWORDS_CONF, deploy_files, generate
from trainmover.security.credentials import from_file

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats"


def spec() -> dict:
    return yaml.safe_load((DEPLOY / "cluster.yaml").read_text())


def test_committed_configs_match_the_generator() -> None:
    expected = deploy_files(spec())
    committed = {p.name: p.read_text() for p in DEPLOY.glob("*.conf")}
    assert committed == expected, (
        "deploy/nats is stale: run trainmover auth deploy --spec deploy/nats/cluster.yaml "
        "--out deploy/nats"
    )


def _with_secrets(tmp_path: Path) -> Path:
    """The deploy configs next to a passwords.conf from `generate`, as on a node."""
    node_dir = tmp_path / "node"
    shutil.copytree(DEPLOY, node_dir)
    store, _ = generate(tmp_path / "secrets", spec()["jobs"], rounds=FAST_BCRYPT)
    shutil.copy(store.root / PASSWORDS_CONF, node_dir / PASSWORDS_CONF)
    return node_dir


def test_nats_server_accepts_every_node_config(tmp_path: Path) -> None:
    node_dir = _with_secrets(tmp_path)
    for conf in sorted(node_dir.glob("nats-*.conf")):
        text = conf.read_text().replace("/data/nats/jetstream", str(tmp_path / conf.stem))
        conf.write_text(text)
        result = subprocess.run(
            [str(server_binary()), "-t", "-c", str(conf)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr


async def test_password_variables_authenticate(tmp_path: Path) -> None:
    node_dir = _with_secrets(tmp_path)
    # The users of the cluster configs on one plain server: the same auth.conf.
    (node_dir / "single.conf").write_text('include "auth.conf"\n')
    server = EmbeddedNats(tmp_path / "js", config_file=node_dir / "single.conf").start()
    try:
        planner = from_file(tmp_path / "secrets" / "creds" / "planner.json")
        nc = await bus.connect(server.url, "planner", auth=planner, max_reconnect_attempts=0)
        await bus.ensure_job(nc.jetstream(), "job1")
        await nc.close()
    finally:
        server.cleanup()
