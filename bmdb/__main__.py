"""The BMDB command-line tool.

    python -m bmdb [--url URL] migrate            apply pending schema migrations
    python -m bmdb [--url URL] machines [--limit N]
    python -m bmdb [--url URL] history MACHINE_ID
    python -m bmdb [--url URL] sessions

Without ``--url`` the standard libpq ``PG*`` environment variables (PGHOST,
PGPORT, PGDATABASE, PGUSER, ...) say where the database is. Errors (database
unreachable, schema newer than this program, bad machine id) are printed as
one line on stderr, with exit status 1; a closed stdout (``| head``) ends the
command quietly (see :mod:`monotrio.cli`).
"""

from __future__ import annotations

import argparse
import datetime
import logging
from collections.abc import Sequence

import trio

import bmdb
from bmdb import migrations
from bmdb.connection import migrate
from bmdb.errors import BMDBError
from bmdb.model import Queries, as_uuid
from monotrio.cli import run_main
from monotrio.text import printable


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    # Cells hold text from machines (causes quote agents and SSH servers):
    # escaped, so that none can drive the terminal or forge a row.
    rows = [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]
    return "\n".join(lines)


def _when(at: datetime.datetime | None) -> str:
    return at.isoformat(timespec="seconds") if at else "-"


async def _migrate(url: str | None) -> str:
    applied = await migrate(url)
    if not applied:
        return f"schema up to date (version {migrations.latest_version()})"
    return "\n".join(f"applied {m.version:04d}_{m.name}" for m in applied)


async def _machines(conn: bmdb.Connection, limit: int) -> str:
    async def fn(q: Queries) -> list[bmdb.model.MachineSummary]:
        return await q.machines(limit)

    machines = await conn.transact(fn, isolation=bmdb.Isolation.REPEATABLE_READ)
    rows = [
        (
            str(m.machine_id),
            f"{m.provided.provider}:{m.provided.provider_id}" if m.provided else "-",
            (m.provided.address or "-") if m.provided else "-",
            str(m.provided.status) if m.provided else "-",
            _when(m.agent_started_at),
            _when(m.agent_heartbeat_at),
            "yes" if m.has_hardware_report else "no",
            ",".join(m.work) or "-",
        )
        for m in machines
    ]
    header = (
        "MACHINE",
        "PROVIDED",
        "ADDRESS",
        "STATUS",
        "AGENT STARTED",
        "HEARTBEAT",
        "HW",
        "WORK",
    )
    return _table(header, rows)


async def _history(conn: bmdb.Connection, machine: str) -> str:
    machine_id = as_uuid(machine)

    async def fn(q: Queries) -> list[bmdb.model.HistoryEvent]:
        return await q.history(machine_id)

    events = await conn.transact(fn, isolation=bmdb.Isolation.REPEATABLE_READ)
    rows = [
        (_when(e.at), str(e.process), str(e.event), str(e.session_id or "-"), e.cause or "")
        for e in events
    ]
    return _table(("AT", "PROCESS", "EVENT", "SESSION", "CAUSE"), rows)


async def _sessions(conn: bmdb.Connection) -> str:
    async def fn(q: Queries) -> list[bmdb.model.SessionInfo]:
        return await q.sessions()

    sessions = await conn.transact(fn, isolation=bmdb.Isolation.REPEATABLE_READ)
    rows = [
        (
            str(s.session_id),
            s.component,
            s.runtime_info,
            _when(s.created_at),
            f"{s.interval:g}s",
            _when(s.deadline),
            "expired" if s.expired else "live",
        )
        for s in sessions
    ]
    header = ("SESSION", "COMPONENT", "RUNTIME", "CREATED", "INTERVAL", "DEADLINE", "STATE")
    return _table(header, rows)


async def _command(args: argparse.Namespace) -> str:
    if args.command == "migrate":
        return await _migrate(args.url)
    async with bmdb.open_connection(args.url, max_connections=1) as conn:
        if args.command == "machines":
            return await _machines(conn, args.limit)
        if args.command == "history":
            return await _history(conn, args.machine)
        return await _sessions(conn)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bmdb",
        description="Inspect and migrate the BMDB.",
        epilog="Without --url, the PG* environment variables locate the database.",
    )
    parser.add_argument("--url", help="libpq connection URL, e.g. postgresql://user@host/db")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("migrate", help="apply pending schema migrations")
    machines = commands.add_parser("machines", help="list machines and their tags")
    machines.add_argument("--limit", type=int, default=1000, help="at most this many (oldest)")
    history = commands.add_parser("history", help="show the work history of a machine")
    history.add_argument("machine", metavar="MACHINE_ID")
    commands.add_parser("sessions", help="list sessions")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    def body() -> int:
        print(trio.run(_command, args))
        return 0

    return run_main("bmdb", body, known=(BMDBError,))


if __name__ == "__main__":
    raise SystemExit(main())
