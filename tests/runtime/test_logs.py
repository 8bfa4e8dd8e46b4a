"""The runtime's log lines go through the one logging set-up: secrets never print."""

from __future__ import annotations

import io
import json

import structlog

from trainmover import logs
from trainmover.runtime import logs as runtime_logs


def test_runtime_logs_redact_secrets_by_key_and_by_value() -> None:
    loaded = "s3cr3t-from-the-creds-file"  # as trainmover.security.credentials registers it
    logs.add_secret(loaded)
    buf = io.StringIO()
    runtime_logs.configure(stream=buf)
    try:
        log = runtime_logs.get_logger(job="j1", machine="m0", local_rank=1)
        log.info("store_connected", token="tok-123456", password="hunter22")
        log.warning("bus_error", detail=f"could not log in with {loaded}")
        log.info("connecting", url="nats://trainer:pa55word@127.0.0.1:4222")
    finally:
        structlog.reset_defaults()
    text = buf.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]
    assert [line["event"] for line in lines] == ["store_connected", "bus_error", "connecting"]
    first, second, third = lines
    assert first["service"] == "runtime" and first["job"] == "j1" and first["machine"] == "m0"
    assert first["token"] == "***" and first["password"] == "***"
    assert second["detail"] == "could not log in with ***"
    assert third["url"] == "nats://***@127.0.0.1:4222"
    for secret in ("tok-123456", "hunter22", loaded, "pa55word"):
        assert secret not in text
