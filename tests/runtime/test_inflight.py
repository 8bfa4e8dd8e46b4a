"""A process whose store helper threads are inside c10d calls when it exits still exits
cleanly: the interpreter waits for those calls before it finalizes, where one coming
back would abort the process (`trainmover.runtime.inflight`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

# Spare connects to a port nothing listens on fail after about 2 s; the process's
# finalization lasts longer than that (an object whose finalizer is slow), so a connect
# left in flight would come back while the interpreter finalizes.
_EXITS_WITH_CONNECTS_IN_FLIGHT = """
import time
from trainmover.freeports import free_ports
from trainmover.runtime import inflight
from trainmover.runtime.tcpstore import spares_of

spares_of("127.0.0.1", free_ports(1)[0], connect_s=1.0, gated=False)
while inflight.in_flight() == 0:
    time.sleep(0.01)

class SlowEnd:
    def __del__(self):
        time.sleep(3)

slow_end = SlowEnd()
print("exiting", inflight.in_flight(), flush=True)
"""


def test_a_process_exits_cleanly_with_store_connects_in_flight() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _EXITS_WITH_CONNECTS_IN_FLIGHT],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0] == "exiting" and int(run.stdout.split()[1]) > 0
    assert "terminate called" not in run.stderr
