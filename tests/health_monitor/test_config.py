"""Settings from flags, environment and files; the CLI entry points."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmover.cli import service_main
from trainmover.services import health_monitor
from trainmover.services.health_monitor.config import ConfigError, load


def test_precedence_flags_env_file(tmp_path: Path) -> None:
    config = tmp_path / "hm.yaml"
    config.write_text("heartbeat_interval: 1.0\nstraggler_steps: 7\ndedup_window: 60\n")
    env = {"TRAINMOVER_HM_STRAGGLER_STEPS": "9", "TRAINMOVER_WEBHOOK_TOKEN": "tok"}
    s = load(["--job", "j1", "--config", str(config), "--dedup-window", "30"], env=env)
    assert s.jobs == ["j1"] and s.heartbeat_interval == 1.0
    assert s.straggler_steps == 9 and s.dedup_window == 30 and s.webhook_token == "tok"
    assert s.heartbeat_timeout == 3.0 and s.grace == 3.0
    assert "tok" not in repr(s)


def test_defaults_match_the_issue() -> None:
    s = load(["--job", "j1"], env={})
    assert s.heartbeat_interval == 0.5 and s.heartbeat_timeout == 1.5
    assert s.watch_statuses == ["active", "standby", "leaving", "joining"]


def test_job_config_as_trainmover_up_passes_it(tmp_path: Path) -> None:
    job_config = tmp_path / "job.toml"
    job_config.write_text(
        'name = "demo"\n[layout]\ntp = 2\n[health_monitor]\nheartbeat_interval = 0.2\n'
    )
    s = load(["--nats-url", "nats://127.0.0.1:1", "--job-config", str(job_config)], env={})
    assert s.jobs == ["demo"] and s.heartbeat_interval == 0.2
    assert s.nats_url == "nats://127.0.0.1:1"


@pytest.mark.parametrize(
    "argv",
    [["--job", "bad name"], ["--job", "j", "--heartbeat-interval", "0"]],
)
def test_bad_settings(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        load(argv, env={})


def test_cli_entry_points(capsys: pytest.CaptureFixture[str]) -> None:
    assert service_main("health-monitor") is health_monitor.main
    assert health_monitor.main(["--job", "bad name"]) == 2
    assert "invalid job name" in capsys.readouterr().err


async def test_without_a_job_the_service_idles(nats_url: str) -> None:
    """`trainmover up` without a job config: serve health and metrics, watch nothing."""
    from trainmover.services.health_monitor.service import HealthMonitor

    from .conftest import http
    from .payloads import RULES_FILE, alert, payload

    settings = load(
        [
            "--nats-url",
            nats_url,
            "--http-host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--rules",
            str(RULES_FILE),
        ],
        env={},
    )
    async with HealthMonitor(settings) as hm:
        await hm.wait_loaded(30)
        assert (await http(hm.port, "/healthz")).status == 200
        reply = await http(hm.port, "/webhook", payload([alert("GPUXidError", node="m1")]))
        assert reply.status == 200 and reply.json()["outcomes"] == {"unknown_machine": 1}
