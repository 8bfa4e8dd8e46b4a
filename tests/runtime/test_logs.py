"""The runtime's log lines go through the one logging set-up: secrets never print; a
worker's threads' stacks are written on SIGUSR1."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time

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


def test_a_worker_writes_its_threads_stacks_at_sigusr1_and_goes_on(tmp_path) -> None:
    program = (
        "import sys, threading\n"
        "from trainmover.runtime import logs\n"
        "logs.configure()\n"
        "def waiting_on_the_store():\n"
        "    threading.Event().wait()\n"
        "threading.Thread(target=waiting_on_the_store, daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "line = sys.stdin.readline()\n"
        "print('went on', line.strip(), flush=True)\n"
    )
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", program],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 30
            # The main thread's stack comes last.
            while "Current thread" not in (tmp_path / "stderr").read_text():
                assert time.monotonic() < deadline, "no stacks written on SIGUSR1"
                time.sleep(0.05)
            proc.stdin.write("after\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "went on after"
        finally:
            proc.kill()
            proc.wait(30)
    assert "in waiting_on_the_store" in (tmp_path / "stderr").read_text()
