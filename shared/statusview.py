"""`trainmover status` as tables: a job at a glance (rich).

Four tables from the planner's cluster state and the migrations the bus still holds:
machines serving a role, standbys with the role types they have warmed, migrations in
flight with their current phase, and the last migrations with their downtime. A job of
more than `LISTED` machines (thousands, for the users this is for) gets a summary
instead of a row per machine: one row per status and role type with its count, and the
machines that are not simply serving (leaving, failed, joining) listed by name; `every`
lists them all. Without a terminal (a pipe, a log) rich writes plain text with no colour
codes, wide enough that no cell is cut.
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
#: Machines (serving, or standbys) listed one a row; past it, a table counts them.
LISTED = 64


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


def _counted(title: str, what: str, rows: list[tuple[str, str]]) -> Table:
    """One row per distinct (status, `what`) with its count: a table of thousands of
    machines that a person can read."""
    table = _table(title, "machines", "status", what)
    counts: dict[tuple[str, str], int] = {}
    for row in rows:
        counts[row] = counts.get(row, 0) + 1
    for (status, value), n in sorted(counts.items()):
        table.add_row(str(n), status, value)
    return table


def _serving(state: ClusterState) -> list[tuple[str, MachineState]]:
    return [(n, m) for n, m in sorted(state.machines.items()) if not _is_standby(m)]


def machines_table(state: ClusterState, every: bool = False) -> Table:
    serving = _serving(state)

    def kind(m: MachineState) -> str:
        return state.layout.role_type(m.cell.pp) if m.cell else "-"

    if not every and len(serving) > LISTED:
        return _counted("machines", "role type", [(m.status, kind(m)) for _, m in serving])
    table = _table("machines", "machine", "status", "role (dp, pp)", "role type")
    for name, m in serving:
        role = f"dp{m.cell.dp} pp{m.cell.pp}" if m.cell else "-"
        table.add_row(name, m.status, role, kind(m))
    return table


def unsettled_table(state: ClusterState) -> Table:
    """The machines serving that are not simply active, by name (the summary's rows
    count them): what a person looking at a large job wants named."""
    table = _table("not active", "machine", "status", "role (dp, pp)")
    for name, m in sorted(state.machines.items()):
        if not _is_standby(m) and m.status != "active":
            role = f"dp{m.cell.dp} pp{m.cell.pp}" if m.cell else "-"
            table.add_row(name, m.status, role)
    return table


def standbys_table(state: ClusterState, every: bool = False) -> Table:
    standbys = [(n, m) for n, m in sorted(state.machines.items()) if _is_standby(m)]

    def warm(m: MachineState) -> str:
        return ", ".join(m.warm_role_types) or "cold"

    if not every and len(standbys) > LISTED:
        return _counted("standbys", "warm role types", [(m.status, warm(m)) for _, m in standbys])
    table = _table("standbys", "machine", "status", "warm role types")
    for name, m in standbys:
        table.add_row(name, m.status, warm(m))
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
    state: ClusterState,
    migrations: list[MigrationProgress],
    file: IO[str] | None = None,
    every: bool = False,
) -> None:
    """Writes the status of a job (to stdout by default); `every` lists each machine of
    a large job too."""
    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console = Console(file=file, highlight=False, width=PIPE_WIDTH, color_system=None)
    lay = state.layout
    console.print(
        f"job {state.job}  layout TP{lay.tp} x PP{lay.pp} x DP{lay.dp}  "
        f"({lay.ranks_per_machine} ranks/machine)  revision {state.revision}"
    )
    counted = not every and len(_serving(state)) > LISTED
    tables = [machines_table(state, every)]
    if counted:  # the machines that need a look, by name
        tables.append(unsettled_table(state))
    tables += [
        standbys_table(state, every),
        in_flight_table(state, migrations),
        last_migrations_table(migrations),
    ]
    for table in tables:
        if table.row_count:
            console.print(table)
        else:
            console.print(f"{table.title}: none")
    if counted:
        console.print(f"{len(state.machines)} machines counted, not listed: --all lists each")
