"""The BMDB command-line tool.

    python -m bmdb [--url URL] migrate            apply pending schema migrations
    python -m bmdb [--url URL] machines [--state S] [--provider P] [--limit N] [--json]
        S: failed, unprovided, needs-agent-start, started, heartbeating, silent,
           or an installation state: installing, installed, install-failed, install-lost
    python -m bmdb [--url URL] machine MACHINE_ID [--json]
    python -m bmdb [--url URL] history MACHINE_ID
    python -m bmdb [--url URL] sessions
    python -m bmdb [--url URL] backup --out FILE       pg_dump, checksummed (bmdb.backup)
    python -m bmdb [--url URL] restore --from FILE     into an empty database
    python -m bmdb [--url URL] audit [--machine MACHINE_ID] [--limit N] [--before ID] [--json]
    python -m bmdb [--url URL] prune --keep-last N --keep-newer-than AGE [--dry-run]
        [--table work_history|audit_log] [--batch ROWS]
        delete old work history and audit records (bmdb.retention)

Each listing (``machines``, ``machine``, ``history``, ``sessions``,
``audit``) takes ``--keep-open SECONDS``: a session process that keeps the
imports answers later listings of the same database (`bmdb.cli.viewlink`,
`bmdb.cli.viewsession`, run as the internal command ``views-session``).

Operator actions, each one transaction with its audit record (see
`bmdb.actions`); ``--reason`` is required, the operator is the OS user
unless ``--operator NAME``; a machine under work is refused unless
``--wait SECONDS`` (then waited for that long)::

    python -m bmdb [--url URL] retry-now MACHINE_ID --reason WHY [--process P]
    python -m bmdb [--url URL] hold MACHINE_ID --reason WHY
    python -m bmdb [--url URL] release MACHINE_ID --reason WHY
    python -m bmdb [--url URL] forget-host-key MACHINE_ID --reason WHY
    python -m bmdb [--url URL] recover-now MACHINE_ID --reason WHY
    python -m bmdb [--url URL] forget-machine MACHINE_ID --reason WHY
    python -m bmdb [--url URL] decommission MACHINE_ID --reason WHY

Without ``--url`` the standard libpq ``PG*`` environment variables (PGHOST,
PGPORT, PGDATABASE, PGUSER, ...) say where the database is. Errors (database
unreachable, schema newer than this program or not migrated, another
application's tables in the way, a role without the privileges, bad machine
id) are printed as one line on stderr, with exit status 1; a closed stdout (``| head``) ends the
command quietly (see :mod:`common.cli`). The web UI is the console's:
``python -m console web`` (``bmdb web`` says so and exits 2).

This module parses the command line and nothing more: a command's modules
are imported when it runs (`bmdb.cli.views` for the listings,
`bmdb.cli.operate` for the rest), so that ``--help`` and a usage error
import neither the driver nor Trio (``tests/test_cli_imports.py``).
"""

from __future__ import annotations

import sys

# Imported where they are used, not here: a listing that a kept-open
# session answers (bmdb.cli.viewlink) runs before any of them, and costs
# little more than the interpreter's start.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    import datetime

    from bmdb.model.enums import Action

#: The commands `bmdb.cli.views` runs (the others: `bmdb.cli.operate`); a
#: test holds them equal to `bmdb.cli.viewlink.VIEWS`.
_VIEWS = ("machines", "machine", "history", "sessions", "audit")


def _action_help() -> dict[Action, str]:
    from bmdb.model.enums import Action

    return {
        Action.RETRY_NOW: "end the machine's backoff: its processes take it again now",
        Action.HOLD: "hold the machine: no process takes it until released",
        Action.RELEASE: "release an operator's hold",
        Action.FORGET_HOST_KEY: "forget the pinned SSH host key (after a real reinstall)",
        Action.RECOVER_NOW: "have the recoverer take the machine now",
        Action.FORGET_MACHINE: "delete a machine its provider no longer lists",
        Action.DECOMMISSION: "wipe the machine, release it to its provider, keep a tombstone",
    }


def _keep_last(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _age(text: str) -> datetime.timedelta:
    import argparse

    from bmdb import retention
    from bmdb.errors import BMDBError

    try:
        return retention.parse_age(text)
    except BMDBError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _batch(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be 1 to 100000 rows, got {value}")
    return value


def _add_prune(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from bmdb import retention

    prune = commands.add_parser(
        "prune",
        help="delete old work history and audit records (retention)",
        description="Delete the rows of the work history and of the audit log that"
        " the policy does not keep: it keeps every row newer than --keep-newer-than"
        " and, whatever their age, each machine's newest --keep-last rows. Deletes"
        " in small batches, each its own short transaction, so that workers and"
        " operators are never blocked; stopping it halfway is safe.",
    )
    prune.add_argument(
        "--keep-last",
        type=_keep_last,
        required=True,
        metavar="N",
        help="keep each machine's newest N rows whatever their age (0: none)",
    )
    prune.add_argument(
        "--keep-newer-than",
        type=_age,
        required=True,
        metavar="AGE",
        help="keep every row newer than AGE: a number and s, m, h or d (e.g. 90d)",
    )
    prune.add_argument(
        "--table",
        action="append",
        choices=list(retention.TABLES),
        help="only this table (repeatable; default: both)",
    )
    prune.add_argument(
        "--batch",
        type=_batch,
        default=retention.DEFAULT_BATCH,
        metavar="ROWS",
        help=f"rows per transaction (default {retention.DEFAULT_BATCH})",
    )
    prune.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")


def _add_backup(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``backup`` and ``restore`` (`bmdb.backup`)."""
    from pathlib import Path

    out = commands.add_parser("backup", help="dump the BMDB into a file (pg_dump), checksummed")
    out.add_argument("--out", type=Path, required=True, metavar="FILE", help="the backup file")
    back = commands.add_parser(
        "restore", help="restore a backup into an empty database; its sessions are dropped"
    )
    back.add_argument(
        "--from", dest="source", type=Path, required=True, metavar="FILE", help="the backup file"
    )
    back.add_argument(
        "--allow-connections",
        action="store_true",
        help="restore although other clients are connected to the database",
    )


def _parser() -> argparse.ArgumentParser:
    import argparse

    from bmdb.cli import add_url_option
    from bmdb.model.enums import Action, Process, Provider
    from bmdb.model.rows import STATE_FILTERS
    from common.argtypes import positive_seconds
    from common.exitcodes import show_in_help

    parser = argparse.ArgumentParser(prog="bmdb", description="Inspect and migrate the BMDB.")
    show_in_help(parser)
    add_url_option(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("migrate", help="apply pending schema migrations")
    machines = commands.add_parser(
        "machines",
        help="list machines: state, work, backoff, upgrade, slot, image, last failure",
    )
    machines.add_argument("--limit", type=int, default=1000, help="at most this many (oldest)")
    machines.add_argument(
        "--state",
        choices=STATE_FILTERS,
        help="only machines in this state (failed: in backoff) or installation state",
    )
    machines.add_argument("--provider", choices=[str(p) for p in Provider])
    machines.add_argument("--after", metavar="MACHINE_ID", help="start after this machine")
    machines.add_argument("--json", action="store_true", help="JSON for scripts")
    machine = commands.add_parser("machine", help="everything about one machine")
    machine.add_argument("machine", metavar="MACHINE_ID")
    machine.add_argument("--json", action="store_true", help="JSON for scripts")
    history = commands.add_parser("history", help="show the work history of a machine")
    history.add_argument("machine", metavar="MACHINE_ID")
    commands.add_parser("sessions", help="list sessions")
    _add_backup(commands)
    audit = commands.add_parser("audit", help="operators' actions, newest first")
    audit.add_argument("--machine", metavar="MACHINE_ID", help="only those on this machine")
    audit.add_argument("--limit", type=int, default=100, help="at most this many")
    audit.add_argument("--before", type=int, metavar="ID", help="only records older than this id")
    audit.add_argument("--json", action="store_true", help="JSON for scripts")
    _add_prune(commands)
    for action, help_text in _action_help().items():
        sub = commands.add_parser(action, help=help_text)
        sub.add_argument("machine", metavar="MACHINE_ID")
        sub.add_argument("--reason", required=True, help="why (kept in the audit log)")
        sub.add_argument(
            "--operator", help="who acts, for the audit log (default: the OS user name)"
        )
        sub.add_argument(
            "--wait",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="wait this long for work on the machine to end (default: refuse at once)",
        )
        if action == Action.RETRY_NOW:
            sub.add_argument(
                "--process",
                choices=[str(p) for p in Process],
                help="end only this process's backoff (default: all)",
            )
    # The web UI moved to the console, above the BMDB (it also shows the
    # cluster); the old command stays only to say where, for muscle memory.
    commands.add_parser("web", help="moved: python -m console web", add_help=False)
    views = commands.choices
    for name in _VIEWS:
        views[name].add_argument(
            "--keep-open",
            type=positive_seconds,
            metavar="SECONDS",
            help="keep a session process with this program's imports for SECONDS after the "
            "last call, and hand later listings with the same options to it (as ssh's "
            "ControlPersist does). The session runs as you; its socket is in a folder only "
            "you can enter ($XDG_RUNTIME_DIR or /tmp, bmdb-views-UID)",
        )
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line ``argv`` (after ``bmdb``) as arguments; SystemExit
    (status 2, the usage on stderr) when the parser refuses it."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "web":
        parser.exit(2, "bmdb: error: the web UI moved: use 'python -m console web'\n")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--keep-open") for a in argv):
        # Before anything heavy: a kept-open session may answer the listing.
        from bmdb.cli import viewlink

        code = viewlink.forward(argv)
        if code is not None:
            return code
    if argv[:1] == ["views-session"]:
        # Internal: the session a listing with --keep-open started.
        from bmdb.cli import viewsession

        return viewsession.main(argv[1:], parse)
    import logging

    from bmdb.errors import BMDBError
    from common.cli import run_main

    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    # Imported now, for the command that runs: its modules and Trio.
    if args.command in _VIEWS:
        from bmdb.cli.views import TRY_AGAIN, run
    else:
        from bmdb.cli.operate import TRY_AGAIN, run

    def body() -> int:
        import trio

        print(trio.run(run, args))
        if getattr(args, "keep_open", None) is not None:
            from bmdb.cli import viewlink

            found = viewlink.scan(argv)
            if found is not None:
                viewlink.start_session(found)
        return 0

    return run_main("bmdb", body, known=(BMDBError,), try_again=TRY_AGAIN)


if __name__ == "__main__":
    raise SystemExit(main())
