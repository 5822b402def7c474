"""``bmdb migrate``, ``backup``, ``restore``, ``prune`` and the operator actions
(``hold``, ``retry-now``, ...): the commands that change the BMDB.

Imported by `bmdb.__main__` only for these commands.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from bmdb import actions, backup, migrations, retention
from bmdb.cli.cells import oneline, when
from bmdb.connection import Connection, migrate, open_connection
from bmdb.errors import BMDBError

__all__ = ["TRY_AGAIN", "run"]

#: Errors that mean "not yet" (`common.exitcodes`): a machine still under
#: work after ``--wait``.
TRY_AGAIN: tuple[type[BaseException], ...] = (actions.MachineBusy,)


async def run(args: argparse.Namespace) -> str:
    """Run the command of ``args``; what to print. Errors: `BMDBError`."""
    if args.command == "migrate":
        return await _migrate(args.url)
    if args.command in backup.COMMANDS:
        return await backup.run_command(args)
    # One command, one query at a time: one connection.
    async with open_connection(args.url, max_connections=1) as conn:
        if args.command == "prune":
            return await _prune(conn, args)
        return await _act(conn, args)


async def _migrate(url: str | None) -> str:
    applied = await migrate(url)
    if not applied:
        return f"schema up to date (version {migrations.latest_version()})"
    return "\n".join(f"applied {m.version:04d}_{m.name}" for m in applied)


async def _prune(conn: Connection, args: argparse.Namespace) -> str:
    policy = retention.RetentionPolicy(
        keep_last=args.keep_last,
        keep_newer_than=args.keep_newer_than,
        batch=args.batch,
    )
    verb = "would delete" if args.dry_run else "deleted"

    def progress(r: retention.PruneResult) -> None:
        if r.batches % PRUNE_PROGRESS_BATCHES == 0:
            print(
                f"bmdb: {r.table}: {verb} {r.deleted} rows, kept {r.kept_old} older ones, so far",
                file=sys.stderr,
                flush=True,
            )

    results = await retention.prune(
        conn,
        policy,
        tables=args.table or tuple(retention.TABLES),
        dry_run=args.dry_run,
        progress=progress,
    )
    return "\n".join(
        f"{r.table}: {verb} {r.deleted} rows older than {when(r.cutoff)}; "
        f"kept {r.kept_old} older ones as their machine's newest {policy.keep_last}"
        + (" (dry run: nothing deleted)" if r.dry_run else "")
        for r in results
    )


#: A prune says how far it is every this many batches.
PRUNE_PROGRESS_BATCHES = 100


async def _act(conn: Connection, args: argparse.Namespace) -> str:
    def waiting(busy: actions.MachineBusy) -> None:
        print(f"bmdb: {busy}; waiting up to {args.wait:g}s", file=sys.stderr, flush=True)

    operator = args.operator
    if operator is None:
        try:
            operator = getpass.getuser()
        except (OSError, KeyError) as e:
            raise BMDBError(f"cannot tell the OS user's name ({e}): give --operator NAME") from e
    record = await actions.act(
        conn,
        args.command,
        args.machine,
        operator=operator,
        reason=args.reason,
        process=getattr(args, "process", None),
        wait=args.wait,
        on_wait=waiting,
    )
    return (
        f"{record.action} machine {record.machine_id}: {oneline(record.detail)}\n"
        f"audit #{record.id} at {when(record.at)} by {oneline(record.operator)}: "
        f"{oneline(record.reason)}"
    )
