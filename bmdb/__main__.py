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
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import json
import logging
import sys
from collections.abc import Sequence

import trio

import bmdb
from bmdb import actions, backup, migrations, overview, retention
from bmdb.cli import add_url_option
from bmdb.connection import STANDBY_NOTE, migrate
from bmdb.errors import BMDBError
from bmdb.model import Queries, as_uuid
from common.cli import run_main
from common.exitcodes import show_in_help
from common.sshkey import fingerprint
from common.text import printable


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


def _oneline(text: str | None) -> str:
    """A database text as one table cell: control characters made visible."""
    if not text:
        return "-"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _left(until: datetime.datetime | None, now: datetime.datetime) -> str:
    """``until`` and the time left to it, e.g. ``2026-01-02T03:04:05+00:00 (4m05s)``."""
    if until is None:
        return "-"
    seconds = max(0, int((until - now).total_seconds()))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    left = f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
    return f"{_when(until)} ({left})"


async def _machines(conn: bmdb.Connection, args: argparse.Namespace) -> str:
    machines = await overview.machines(
        conn, limit=args.limit, state=args.state, provider=args.provider, after=args.after
    )
    if args.json:
        return json.dumps([m.to_json() for m in machines], indent=1)
    now = datetime.datetime.now(datetime.UTC)
    rows = [
        (
            str(m.machine_id),
            m.state,
            _install(m.install_state, m.install_generation)
            if m.was_install_state is None
            else f"was:{_install(m.was_install_state, m.install_generation)}",
            "-"
            if m.node_id is None
            else f"was:{m.node_id}"
            if m.state == overview.State.DECOMMISSIONED
            else m.node_id,
            f"{m.provider}:{_oneline(m.provider_id)}" if m.provider else "-",
            _oneline(m.address),
            _when(m.agent_heartbeat_at),
            ",".join(m.work) or "-",
            _left(m.backoff_until, now),
            _oneline(m.hold.held_by)
            if m.hold
            else f"decommission:{m.decommission}"
            if m.decommission
            else "-",
            _oneline(m.cause),
        )
        for m in machines
    ]
    header = (
        "MACHINE", "STATE", "INSTALL", "NODE", "PROVIDED", "ADDRESS", "HEARTBEAT", "WORK",
        "BACKOFF", "HELD", "CAUSE",
    )  # fmt: skip
    return _table(header, rows)


def _install(state: object | None, generation: int | None) -> str:
    """``installed@2``: the installation state and its generation, or ``-``."""
    return "-" if state is None else f"{state}@{generation}"


async def _machine(conn: bmdb.Connection, args: argparse.Namespace) -> str:
    detail = await overview.machine(conn, args.machine)
    if detail is None:
        forgotten = await overview.audit(conn, machine=args.machine, limit=1)
        if forgotten:
            raise BMDBError(
                f"no machine {args.machine} (last operator action: {forgotten[0].action}, "
                f"audit #{forgotten[0].id}; see 'bmdb audit --machine {args.machine}')"
            )
        raise BMDBError(f"no machine {args.machine}")
    m = detail.summary
    if args.json:
        return json.dumps(_detail_json(detail), indent=1)
    fields = [
        ("machine", str(m.machine_id)),
        ("created", _when(m.created_at)),
        ("state", m.state),
        ("provider", f"{m.provider}:{_oneline(m.provider_id)}" if m.provider else "-"),
        ("address", _oneline(m.address)),
        ("location", _oneline(detail.location)),
        ("provider status", m.provider_status or "-"),
        ("agent started", _when(m.agent_started_at)),
        ("agent key", detail.agent_public_key.hex() if detail.agent_public_key else "-"),
        ("heartbeat", _when(m.agent_heartbeat_at)),
        ("hardware report", _size(detail.hardware_report_bytes)),
        *_installation_fields(detail.installation),
        ("ssh host key", fingerprint(detail.ssh_host_key) if detail.ssh_host_key else "-"),
        ("ssh host key first seen", _when(detail.ssh_host_key_first_seen)),
        ("last failure", _when(m.failed_at)),
        ("last failure cause", _oneline(m.failed_cause)),
        ("held", _held(m.hold)),
        ("decommission", _oneline(detail.decommission)),
        (
            "recovery requested",
            f"by {_oneline(detail.recovery_requested_by)} at {_when(detail.recovery_requested_at)}"
            if detail.recovery_requested_by
            else "-",
        ),
    ]
    width = max(len(k) for k, _ in fields)
    out = [f"{k + ':':<{width + 1}} {v}" for k, v in fields]
    out += ["", "WORK"]
    out.append(
        _table(
            ("PROCESS", "SESSION", "COMPONENT", "STATE"),
            [
                (w.process, str(w.session_id), _oneline(w.component), "live" if w.live else "dead")
                for w in detail.work
            ],
        )
    )
    out += ["", "BACKOFF"]
    out.append(
        _table(
            ("PROCESS", "UNTIL", "INTERVAL", "STATE", "CAUSE"),
            [
                (
                    b.process,
                    _left(b.until, detail.now) if b.active else _when(b.until),
                    f"{b.interval_seconds}s",
                    "active" if b.active else "over",
                    _oneline(b.cause),
                )
                for b in detail.backoffs
            ],
        )
    )
    out += ["", "HISTORY"]
    out.append(
        _table(
            ("AT", "PROCESS", "EVENT", "SESSION", "CAUSE"),
            [
                (_when(e.at), e.process, e.event, str(e.session_id or "-"), _oneline(e.cause))
                for e in detail.history
            ],
        )
    )
    out += ["", "OPERATOR ACTIONS"]
    out.append(_audit_table(detail.audit, with_machine=False))
    return "\n".join(out)


def _held(hold: bmdb.model.Hold | None) -> str:
    if hold is None:
        return "-"
    return f"by {_oneline(hold.held_by)} since {_when(hold.held_at)}: {_oneline(hold.reason)}"


def _audit_table(records: Sequence[bmdb.model.AuditRecord], *, with_machine: bool) -> str:
    header = ("ID", "AT", "OPERATOR", "ACTION", *(["MACHINE"] if with_machine else []),
              "REASON", "DETAIL")  # fmt: skip
    rows = [
        (
            str(a.id),
            _when(a.at),
            _oneline(a.operator),
            a.action,
            *([str(a.machine_id or "-")] if with_machine else []),
            _oneline(a.reason),
            _oneline(a.detail),
        )
        for a in records
    ]
    return _table(header, rows)


def _audit_json(a: bmdb.model.AuditRecord) -> dict[str, object]:
    return {
        "id": a.id,
        "at": a.at.isoformat(),
        "operator": a.operator,
        "action": a.action,
        "machine_id": a.machine_id and str(a.machine_id),
        "reason": a.reason,
        "detail": a.detail,
    }


async def _audit(conn: bmdb.Connection, args: argparse.Namespace) -> str:
    records = await overview.audit(conn, machine=args.machine, limit=args.limit, before=args.before)
    if args.json:
        return json.dumps([_audit_json(a) for a in records], indent=1)
    return _audit_table(records, with_machine=True)


async def _prune(conn: bmdb.Connection, args: argparse.Namespace) -> str:
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
        f"{r.table}: {verb} {r.deleted} rows older than {_when(r.cutoff)}; "
        f"kept {r.kept_old} older ones as their machine's newest {policy.keep_last}"
        + (" (dry run: nothing deleted)" if r.dry_run else "")
        for r in results
    )


#: A prune says how far it is every this many batches.
PRUNE_PROGRESS_BATCHES = 100


async def _act(conn: bmdb.Connection, args: argparse.Namespace) -> str:
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
        f"{record.action} machine {record.machine_id}: {_oneline(record.detail)}\n"
        f"audit #{record.id} at {_when(record.at)} by {_oneline(record.operator)}: "
        f"{_oneline(record.reason)}"
    )


def _installation_fields(i: bmdb.model.OSInstallation | None) -> list[tuple[str, str]]:
    """The request of the current generation, and the report on it."""
    if i is None:
        return [("install", "-")]
    fields = [
        ("install", f"{i.state} (generation {i.generation})"),
        ("install requested", _when(i.requested_at)),
        ("install root device", _oneline(i.root_device)),
        ("install image", _oneline(i.image_digest)),
        ("install node address", _oneline(i.node_address)),
    ]
    if i.reported:
        fields += [
            ("install reported", _when(i.reported_at)),
            ("install outcome", "success" if i.success else "error"),
        ]
        if i.success:
            fields.append(("install node", i.node_id or "- (no key reported)"))
        else:
            fields.append(("install cause", _oneline(i.cause)))
    elif i.report_generation is not None:
        fields.append(("install last report", _generation(i.report_generation)))
    return fields


def _installation_json(i: bmdb.model.OSInstallation | None) -> dict[str, object] | None:
    if i is None:
        return None
    return {
        "state": str(i.state),
        "generation": i.generation,
        "requested_at": i.requested_at.isoformat(),
        "root_device": i.root_device,
        "image_digest": i.image_digest,
        "node_address": i.node_address,
        "report_generation": i.report_generation,
        "reported_at": _iso(i.reported_at),
        "success": i.success,
        "cause": i.cause,
        "node_public_key": i.node_public_key.hex() if i.node_public_key else None,
        "node_id": i.node_id,
    }


def _iso(at: datetime.datetime | None) -> str | None:
    return at.isoformat() if at else None


def _size(n: int | None) -> str:
    return "-" if n is None else f"{n} bytes"


def _generation(n: int | None) -> str:
    return "-" if n is None else f"generation {n}"


def _detail_json(d: overview.MachineDetail) -> dict[str, object]:
    return d.summary.to_json() | {
        "location": d.location,
        "agent_public_key": d.agent_public_key.hex() if d.agent_public_key else None,
        "hardware_report_bytes": d.hardware_report_bytes,
        "os_installation_request_generation": d.os_installation_request_generation,
        "os_installation_report_generation": d.os_installation_report_generation,
        "ssh_host_key": d.ssh_host_key.hex() if d.ssh_host_key else None,
        "installation": _installation_json(d.installation),
        "work": [
            {"process": w.process, "session_id": str(w.session_id), "component": w.component,
             "live": w.live}
            for w in d.work
        ],
        "backoffs": [
            {"process": b.process, "until": b.until.isoformat(), "cause": b.cause,
             "interval_seconds": b.interval_seconds, "active": b.active}
            for b in d.backoffs
        ],
        "history": [
            {"at": e.at.isoformat(), "process": e.process, "event": e.event,
             "session_id": e.session_id and str(e.session_id), "cause": e.cause}
            for e in d.history
        ],
    }  # fmt: skip


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


#: Printed under a listing that was read from a standby.
async def _command(args: argparse.Namespace) -> str:
    if args.command == "migrate":
        return await _migrate(args.url)
    if args.command in backup.COMMANDS:
        return await backup.run_command(args)
    # One command, one query at a time: one connection.
    async with bmdb.open_connection(args.url, max_connections=1) as conn:
        if args.command == "machines":
            out = await _machines(conn, args)
        elif args.command == "machine":
            out = await _machine(conn, args)
        elif args.command == "history":
            out = await _history(conn, args.machine)
        elif args.command == "audit":
            out = await _audit(conn, args)
        elif args.command == "prune":
            return await _prune(conn, args)
        elif args.command in set(actions.Action):
            return await _act(conn, args)
        else:
            out = await _sessions(conn)
        # A multi-host URL with target_session_attrs=prefer-standby reads
        # from a standby: say so (JSON stays machine-readable).
        if not getattr(args, "json", False) and await conn.on_standby():
            out += f"\n{STANDBY_NOTE}"
        return out


_ACTION_HELP = {
    actions.Action.RETRY_NOW: "end the machine's backoff: its processes take it again now",
    actions.Action.HOLD: "hold the machine: no process takes it until released",
    actions.Action.RELEASE: "release an operator's hold",
    actions.Action.FORGET_HOST_KEY: "forget the pinned SSH host key (after a real reinstall)",
    actions.Action.RECOVER_NOW: "have the recoverer take the machine now",
    actions.Action.FORGET_MACHINE: "delete a machine its provider no longer lists",
    actions.Action.DECOMMISSION: "wipe the machine, release it to its provider, keep a tombstone",
}


def _keep_last(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _age(text: str) -> datetime.timedelta:
    try:
        return retention.parse_age(text)
    except BMDBError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _batch(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be 1 to 100000 rows, got {value}")
    return value


def _add_prune(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bmdb", description="Inspect and migrate the BMDB.")
    show_in_help(parser)
    add_url_option(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("migrate", help="apply pending schema migrations")
    machines = commands.add_parser(
        "machines", help="list machines: state, work, backoff end and last failure cause"
    )
    machines.add_argument("--limit", type=int, default=1000, help="at most this many (oldest)")
    machines.add_argument(
        "--state",
        choices=overview.STATE_FILTERS,
        help="only machines in this state (failed: in backoff) or installation state",
    )
    machines.add_argument("--provider", choices=[str(p) for p in bmdb.Provider])
    machines.add_argument("--after", metavar="MACHINE_ID", help="start after this machine")
    machines.add_argument("--json", action="store_true", help="JSON for scripts")
    machine = commands.add_parser("machine", help="everything about one machine")
    machine.add_argument("machine", metavar="MACHINE_ID")
    machine.add_argument("--json", action="store_true", help="JSON for scripts")
    history = commands.add_parser("history", help="show the work history of a machine")
    history.add_argument("machine", metavar="MACHINE_ID")
    commands.add_parser("sessions", help="list sessions")
    backup.add_commands(commands)
    audit = commands.add_parser("audit", help="operators' actions, newest first")
    audit.add_argument("--machine", metavar="MACHINE_ID", help="only those on this machine")
    audit.add_argument("--limit", type=int, default=100, help="at most this many")
    audit.add_argument("--before", type=int, metavar="ID", help="only records older than this id")
    audit.add_argument("--json", action="store_true", help="JSON for scripts")
    _add_prune(commands)
    for action, help_text in _ACTION_HELP.items():
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
        if action == actions.Action.RETRY_NOW:
            sub.add_argument(
                "--process",
                choices=[str(p) for p in bmdb.Process],
                help="end only this process's backoff (default: all)",
            )
    # The web UI moved to the console, above the BMDB (it also shows the
    # cluster); the old command stays only to say where, for muscle memory.
    commands.add_parser("web", help="moved: python -m console web", add_help=False)
    args, unknown = parser.parse_known_args(argv)
    if args.command == "web":
        parser.exit(2, "bmdb: error: the web UI moved: use 'python -m console web'\n")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    def body() -> int:
        print(trio.run(_command, args))
        return 0

    return run_main("bmdb", body, known=(BMDBError,), try_again=(actions.MachineBusy,))


if __name__ == "__main__":
    raise SystemExit(main())
