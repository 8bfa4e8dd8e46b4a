"""The demo's screen: a live display on a terminal, a few plain lines otherwise.

On a terminal (rich Live): the step and step rate, every machine with its status, role
and warmed role types, and each migration with the phases it went through, updated
four times a second; the demo's own lines scroll above it. Not on a terminal (a pipe,
CI): a line when a migration is planned, one when it ends with its downtime and
phases, and a status line every STATUS_EVERY_S seconds, so a whole run stays short.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from trainmover.jobview import JobView, MigrationView
from trainmover.messages import TERMINAL_STATES
from trainmover.tasks import cancel_and_wait

STATUS_EVERY_S = 30.0


def migration_line(m: MigrationView) -> str:
    """One migration in a line: kind, who moves, state, downtime and the phases so far."""
    who = f"{m.leaver or m.machine or '?'} -> {m.joiner or '?'}"
    text = f"{m.kind:<9} {who:<10} {m.state}"
    if m.ended and m.downtime_s is not None:
        text += f", downtime {m.downtime_s:.3f} s"
    measured = {k: v for k, v in m.phases.items() if k != "downtime"}
    if m.ended and measured:
        phases = ", ".join(f"{k} {v:.3f} s" for k, v in measured.items())
    else:
        phases = " > ".join(f"{s} {d:.1f}s" for s, d in m.timeline() if s not in TERMINAL_STATES)
    return f"{text}  ({phases})" if phases else text


def status_line(view: JobView) -> str:
    total = f"/{view.total_steps}" if view.total_steps else ""
    machines = view.machines()
    serving = [m["machine"] for m in machines if m["role"]]
    standbys = [
        f"{m['machine']} ({'warm' if m['warm'] else 'cold' if m['status'] == 'standby' else m['status']})"
        for m in machines
        if m["standby"]
    ]
    out = [
        f"{m['machine']} ({m['status']})" for m in machines if not m["role"] and not m["standby"]
    ]
    line = (
        f"step {view.step}{total} at {view.step_rate():.2f} steps/s; "
        f"serving {' '.join(serving) or '-'}; standbys {', '.join(standbys) or '-'}"
    )
    return line + (f"; out {', '.join(out)}" if out else "")


class DemoDisplay:
    """Shows `view` while the demo runs; an async context manager."""

    def __init__(self, view: JobView, console: Console | None = None) -> None:
        self.view = view
        self.console = console or Console(highlight=False)
        self.live = self.console.is_terminal
        self._live: Live | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = time.monotonic()

    async def __aenter__(self) -> DemoDisplay:
        if self.live:
            self._live = Live(
                self.render(), console=self.console, refresh_per_second=4, redirect_stdout=True
            )
            self._live.start()
            self._tasks.append(asyncio.create_task(self._refresh()))
        else:
            self.view.listeners.append(self._print_migration)
            self._tasks.append(asyncio.create_task(self._print_status()))
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await cancel_and_wait(self._tasks, owner="demo-display")
        if self._live is not None:
            self._live.update(self.render())
            self._live.stop()

    def _print_migration(self, m: MigrationView) -> None:
        if m.state == "planned" or m.ended:
            print(f"  migration {migration_line(m)}", flush=True)

    async def _print_status(self) -> None:
        last = ""
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            line = status_line(self.view)
            if line != last:  # a finished job says nothing new
                print(f"  {line}", flush=True)
                last = line

    async def _refresh(self) -> None:
        assert self._live is not None
        while True:
            self._live.update(self.render())
            await asyncio.sleep(0.25)

    def render(self) -> RenderableType:
        v = self.view
        elapsed = int(time.monotonic() - self._started)
        total = f" / {v.total_steps}" if v.total_steps else ""
        head = Text(
            f"step {v.step}{total}   {v.step_rate():.2f} steps/s   "
            f"elapsed {elapsed // 60}:{elapsed % 60:02d}",
            style="bold",
        )
        machines = Table("machine", "status", "role", "warm role types", box=None, pad_edge=False)
        for m in v.machines():
            machines.add_row(m["machine"], m["status"], m["role"] or "-", ", ".join(m["warm"]))
        migrations = Table("migrations", box=None, pad_edge=False)
        for mig in list(v.migrations.values())[-6:]:
            if mig.states:
                migrations.add_row(migration_line(mig))
        return Group(head, machines, migrations)
