"""The local stack's shutdown order, with real processes standing in for its parts."""

from __future__ import annotations

import asyncio
from pathlib import Path

from trainmover.stack import Stack

# Writes its name to the order file when asked to stop (SIGTERM), like a service would.
STAND_IN = 'trap "echo $0 >> $1; exit 0" TERM; echo up; while :; do sleep 0.05; done'


async def _stand_in(name: str, order: Path) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", STAND_IN, name, str(order), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"up\n"  # the trap is set
    return proc


async def test_the_health_monitor_stops_before_the_machines_and_they_before_the_planner(
    tmp_path: Path,
) -> None:
    # A machine stopped while the monitor still watches is reported failed, and the
    # planner would plan a recovery for a job being shut down.
    order = tmp_path / "order"
    stack = Stack(run_dir=tmp_path / "run")
    for name in ("planner", "executor", "health-monitor"):
        stack._procs[name] = await _stand_in(name, order)
    for name in ("m0", "m1"):
        stack.machines[name] = await _stand_in(name, order)

    await stack.__aexit__(None, None, None)

    stopped = order.read_text().split()
    assert stopped[0] == "health-monitor"
    assert sorted(stopped[1:3]) == ["m0", "m1"]
    assert sorted(stopped[3:]) == ["executor", "planner"]
    assert not stack.machines and not stack._procs


def test_the_health_monitor_gets_the_shipped_alert_rules_unless_told_otherwise(
    tmp_path: Path,
) -> None:
    from trainmover.services.health_monitor.rules import load_rules
    from trainmover.stack import SHIPPED_RULES

    def rules_of(stack: Stack) -> str:
        args = stack._args("health-monitor")
        return args[args.index("--rules") + 1]

    shipped = rules_of(Stack(run_dir=tmp_path / "a"))
    assert shipped == str(SHIPPED_RULES)
    assert load_rules(shipped).rules  # a real rule set, not an empty one
    mine = tmp_path / "rules.yaml"
    mine.write_text("rules: []\n")
    assert rules_of(Stack(run_dir=tmp_path / "b", rules=str(mine))) == str(mine)
