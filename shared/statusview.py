"""`trainmover status` as tables: a job at a glance (rich).

Four tables from the planner's cluster state and the migrations the bus still holds:
machines serving a role, standbys with the role types they have warmed, migrations in
flight with their current phase, and the last migrations with their downtime. Without a
terminal (a pipe, a log) rich writes plain text with no colour codes, wide enough that
no cell is cut.
"""

from __future__ import annotations

from typing import IO

from rich import box
from rich.console import Console
from rich.table import Table

from trainmover.messages import TERMINAL_STATES, ClusterState, MachineState, MigrationProgress

#: Ended migrations shown (the bus keeps more; `--json` has them all).
LAST_MIGRATIONS = 10
#: Width when the output is not a terminal: room for every column, nothing wrapped.
PIPE_WIDTH = 160


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        table.add_column(column, no_wrap=column != "detail")
    return table


def _is_standby(m: MachineState) -> bool:
    """Waiting for a role (a standby, one still joining, one back from maintenance)."""
    return m.cell is None and m.status in ("standby", "joining", "maintenance")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def machines_table(state: ClusterState) -> Table:
    table = _table("machines", "machine", "status", "role (dp, pp)", "role type")
    for name, m in sorted(state.machines.items()):
        if _is_standby(m):
            continue
        role = f"dp{m.cell.dp} pp{m.cell.pp}" if m.cell else "-"
        kind = state.layout.role_type(m.cell.pp) if m.cell else "-"
        table.add_row(name, m.status, role, kind)
    return table


def standbys_table(state: ClusterState) -> Table:
    table = _table("standbys", "machine", "status", "warm role types")
    for name, m in sorted(state.machines.items()):
        if _is_standby(m):
            table.add_row(name, m.status, ", ".join(m.warm_role_types) or "cold")
    return table


def in_flight_table(state: ClusterState, migrations: list[MigrationProgress]) -> Table:
    """Plans being executed with the phase their latest progress reports."""
    phase = {m.event_id: m.state for m in migrations}
    table = _table("in flight", "event", "kind", "moves", "phase", "delta groups", "plan")
    for plan in state.in_flight.values():
        moves = ", ".join(f"{mv.leaver} -> {mv.joiner}" for mv in plan.moves)
        table.add_row(
            plan.event_id[:10],
            plan.migration,
            moves,
            phase.get(plan.event_id, "planned"),
            str(len(plan.groups)),
            plan.plan_id[:8],
        )
    # A migration whose plan the state no longer lists (e.g. an executor's recovery)
    # is still in flight until a terminal progress arrives; a queued one has its own row.
    listed = {p.event_id for p in state.in_flight.values()} | {q.event_id for q in state.queued}
    for m in migrations:
        if m.state not in TERMINAL_STATES and m.event_id not in listed:
            who = f"{m.leaver or '?'} -> {m.joiner or '?'}"
            table.add_row(m.event_id[:10], "-", who, m.state, "-", (m.plan_id or "-")[:8])
    for queued in state.queued:
        table.add_row(queued.event_id[:10], "queued", queued.machine, "no standby free", "-", "-")
    return table


def last_migrations_table(migrations: list[MigrationProgress]) -> Table:
    table = _table("last migrations", "event", "leaver -> joiner", "state", "downtime", "detail")
    ended = [m for m in migrations if m.state in TERMINAL_STATES][-LAST_MIGRATIONS:]
    for m in ended:
        who = f"{m.leaver or '-'} -> {m.joiner or '-'}"
        table.add_row(m.event_id[:10], who, m.state, _seconds(m.downtime_s), m.detail[:80])
    return table


def render(
    state: ClusterState, migrations: list[MigrationProgress], file: IO[str] | None = None
) -> None:
    """Writes the status of a job (to stdout by default)."""
    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console = Console(file=file, highlight=False, width=PIPE_WIDTH, color_system=None)
    lay = state.layout
    console.print(
        f"job {state.job}  layout TP{lay.tp} x PP{lay.pp} x DP{lay.dp}  "
        f"({lay.ranks_per_machine} ranks/machine)  revision {state.revision}"
    )
    for table in (
        machines_table(state),
        standbys_table(state),
        in_flight_table(state, migrations),
        last_migrations_table(migrations),
    ):
        if table.row_count:
            console.print(table)
        else:
            console.print(f"{table.title}: none")
