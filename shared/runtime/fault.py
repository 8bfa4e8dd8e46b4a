"""TEST-ONLY fault injection: a worker SIGKILLs its whole machine at a named point of a step.

Set ``TM_TEST_FAULT`` to a comma-separated list of ``<machine>@<step>:<point>`` (e.g.
``m0@6:forward,m3@12:backward``; ``*`` for any step); a worker of that machine, on reaching `point` during
`step`, records the time in ``$TM_RUN_DIR/faults.jsonl`` and kills every process of its
process group (the launcher starts each machine's workers in one group), as a machine
failure would. Points: ``forward``, ``backward`` (reference train step), ``dp-allreduce``
(gradient all-reduce posted, not finished), ``dp-reduce-scatter`` (FSDP2's gradient
reduce-scatter posted, not finished), ``after-allreduce`` (all-reduce done, before
the commit vote), ``after-dump`` (the step committed and its state dumped, before the
next step), ``transfer`` (a sender of a state transfer after its first two chunks, at the
boundary after `step`). Never set in production; without the variable every call is a no-op.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

ENV = "TM_TEST_FAULT"

ANY_STEP = -1
_step = 0
_targets: set[tuple[int, str]] = set()


def arm(machine: str) -> None:
    """Reads this machine's fault points from the environment (once per process)."""
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        name, _, rest = item.partition("@")
        step, _, point = rest.partition(":")
        if name == machine:
            _targets.add((ANY_STEP if step == "*" else int(step), point))


def at_step(step: int) -> None:
    """The runtime tells the hook which step is in flight."""
    global _step
    _step = step


def point(name: str) -> None:
    """Kills this machine here if a fault is armed for (current step, `name`)."""
    if (_step, name) not in _targets and (ANY_STEP, name) not in _targets:
        return
    run_dir = os.environ.get("TM_RUN_DIR")
    if run_dir:
        with open(Path(run_dir) / "faults.jsonl", "a") as f:
            f.write(json.dumps({"step": _step, "point": name, "t": time.time()}) + "\n")
    # Only a group of our own (one per machine) is killed; never our parent's.
    if os.getpgrp() != os.getpgid(os.getppid()):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
