"""``bmdb machines``, ``machine``, ``history``, ``sessions`` and ``audit``:
what an operator reads of the fleet (`bmdb.overview`), printed.

Imported by `bmdb.__main__` only for these commands.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence

from bmdb import model, overview
from bmdb.cli.cells import left, oneline, table, when
from bmdb.connection import STANDBY_NOTE, Connection, open_connection
from bmdb.errors import BMDBError
from bmdb.model import Queries, as_uuid
from bmdb.transaction import Isolation
from common.sshkey import fingerprint

__all__ = ["TRY_AGAIN", "run", "run_on"]

#: Errors that mean "not yet" (`common.exitcodes`): none here.
TRY_AGAIN: tuple[type[BaseException], ...] = ()


async def run(args: argparse.Namespace) -> str:
    """Run the command of ``args`` (one of the module docstring's); what to print.

    One query at a time, on one connection. A listing read from a standby
    says so below it (JSON stays machine-readable). Errors: `BMDBError`.
    """
    async with open_connection(args.url, max_connections=1) as conn:
        return await run_on(conn, args)


async def run_on(conn: Connection, args: argparse.Namespace) -> str:
    """:func:`run` on ``conn``, a connection to the database ``args`` name."""
    if args.command == "machines":
        out = await _machines(conn, args)
    elif args.command == "machine":
        out = await _machine(conn, args)
    elif args.command == "history":
        out = await _history(conn, args.machine)
    elif args.command == "audit":
        out = await _audit(conn, args)
    else:
        out = await _sessions(conn)
    # A multi-host URL with target_session_attrs=prefer-standby reads
    # from a standby: say so.
    if not getattr(args, "json", False) and await conn.on_standby():
        out += f"\n{STANDBY_NOTE}"
    return out


async def _machines(conn: Connection, args: argparse.Namespace) -> str:
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
            f"{m.provider}:{oneline(m.provider_id)}" if m.provider else "-",
            oneline(m.address),
            when(m.agent_heartbeat_at),
            ",".join(m.work) or "-",
            left(m.backoff_until, now),
            oneline(m.hold.held_by)
            if m.hold
            else f"decommission:{m.decommission}"
            if m.decommission
            else "-",
            m.upgrade_state or "-",
            (m.slot or "-").upper(),
            m.image.removeprefix("sha256:")[:12] if m.image else "-",
            oneline(m.cause),
        )
        for m in machines
    ]
    header = (
        "MACHINE", "STATE", "INSTALL", "NODE", "PROVIDED", "ADDRESS", "HEARTBEAT", "WORK",
        "BACKOFF", "HELD", "UPGRADE", "SLOT", "IMAGE", "CAUSE",
    )  # fmt: skip
    return table(header, rows)


def _install(state: object | None, generation: int | None) -> str:
    """``installed@2``: the installation state and its generation, or ``-``."""
    return "-" if state is None else f"{state}@{generation}"


async def _machine(conn: Connection, args: argparse.Namespace) -> str:
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
        ("created", when(m.created_at)),
        ("state", m.state),
        ("provider", f"{m.provider}:{oneline(m.provider_id)}" if m.provider else "-"),
        ("address", oneline(m.address)),
        ("location", oneline(detail.location)),
        ("provider status", m.provider_status or "-"),
        ("agent started", when(m.agent_started_at)),
        ("agent key", detail.agent_public_key.hex() if detail.agent_public_key else "-"),
        ("heartbeat", when(m.agent_heartbeat_at)),
        *_hardware_fields(detail),
        *_installation_fields(detail.installation),
        ("upgrade", m.upgrade_state or "-"),
        ("slot", (m.slot or "-").upper()),
        ("image", oneline(m.image)),
        ("ssh host key", fingerprint(detail.ssh_host_key) if detail.ssh_host_key else "-"),
        ("ssh host key first seen", when(detail.ssh_host_key_first_seen)),
        ("last failure", when(m.failed_at)),
        ("last failure cause", oneline(m.failed_cause)),
        ("held", _held(m.hold)),
        ("decommission", oneline(detail.decommission)),
        (
            "recovery requested",
            f"by {oneline(detail.recovery_requested_by)} at {when(detail.recovery_requested_at)}"
            if detail.recovery_requested_by
            else "-",
        ),
    ]
    width = max(len(k) for k, _ in fields)
    out = [f"{k + ':':<{width + 1}} {v}" for k, v in fields]
    out += ["", "WORK"]
    out.append(
        table(
            ("PROCESS", "SESSION", "COMPONENT", "STATE"),
            [
                (w.process, str(w.session_id), oneline(w.component), "live" if w.live else "dead")
                for w in detail.work
            ],
        )
    )
    out += ["", "BACKOFF"]
    out.append(
        table(
            ("PROCESS", "UNTIL", "INTERVAL", "STATE", "CAUSE"),
            [
                (
                    b.process,
                    left(b.until, detail.now) if b.active else when(b.until),
                    f"{b.interval_seconds}s",
                    "active" if b.active else "over",
                    oneline(b.cause),
                )
                for b in detail.backoffs
            ],
        )
    )
    out += ["", "HISTORY"]
    out.append(
        table(
            ("AT", "PROCESS", "EVENT", "SESSION", "CAUSE"),
            [
                (when(e.at), e.process, e.event, str(e.session_id or "-"), oneline(e.cause))
                for e in detail.history
            ],
        )
    )
    out += ["", "OPERATOR ACTIONS"]
    out.append(_audit_table(detail.audit, with_machine=False))
    return "\n".join(out)


def _held(hold: model.Hold | None) -> str:
    if hold is None:
        return "-"
    return f"by {oneline(hold.held_by)} since {when(hold.held_at)}: {oneline(hold.reason)}"


def _audit_table(records: Sequence[model.AuditRecord], *, with_machine: bool) -> str:
    header = ("ID", "AT", "OPERATOR", "ACTION", *(["MACHINE"] if with_machine else []),
              "REASON", "DETAIL")  # fmt: skip
    rows = [
        (
            str(a.id),
            when(a.at),
            oneline(a.operator),
            a.action,
            *([str(a.machine_id or "-")] if with_machine else []),
            oneline(a.reason),
            oneline(a.detail),
        )
        for a in records
    ]
    return table(header, rows)


def _audit_json(a: model.AuditRecord) -> dict[str, object]:
    return {
        "id": a.id,
        "at": a.at.isoformat(),
        "operator": a.operator,
        "action": a.action,
        "machine_id": a.machine_id and str(a.machine_id),
        "reason": a.reason,
        "detail": a.detail,
    }


async def _audit(conn: Connection, args: argparse.Namespace) -> str:
    records = await overview.audit(conn, machine=args.machine, limit=args.limit, before=args.before)
    if args.json:
        return json.dumps([_audit_json(a) for a in records], indent=1)
    return _audit_table(records, with_machine=True)


def _installation_fields(i: model.OSInstallation | None) -> list[tuple[str, str]]:
    """The request of the current generation, and the report on it."""
    if i is None:
        return [("install", "-")]
    fields = [
        ("install", f"{i.state} (generation {i.generation})"),
        ("install requested", when(i.requested_at)),
        ("install root device", oneline(i.root_device)),
        ("install image", oneline(i.image_digest)),
        ("install node address", oneline(i.node_address)),
    ]
    if i.reported:
        fields += [
            ("install reported", when(i.reported_at)),
            ("install outcome", "success" if i.success else "error"),
        ]
        if i.success:
            fields.append(("install node", i.node_id or "- (no key reported)"))
        else:
            fields.append(("install cause", oneline(i.cause)))
    elif i.report_generation is not None:
        fields.append(("install last report", _generation(i.report_generation)))
    return fields


def _installation_json(i: model.OSInstallation | None) -> dict[str, object] | None:
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


def _hardware_fields(d: overview.MachineDetail) -> list[tuple[str, str]]:
    """The stored hardware report: its size, then what it says (`common.hwreport`)."""
    if d.hardware_report_bytes is None:
        return [("hardware report", "-")]
    if d.hardware is None:
        return [("hardware report", f"unreadable: {d.hardware_unreadable}")]
    return [("hardware report", f"{d.hardware_report_bytes} bytes"), *d.hardware.lines()]


def _hardware_json(d: overview.MachineDetail) -> dict[str, object] | None:
    if d.hardware is not None:
        return d.hardware.to_json()
    if d.hardware_unreadable is not None:
        return {"unreadable": d.hardware_unreadable}
    return None


def _generation(n: int | None) -> str:
    return "-" if n is None else f"generation {n}"


def _detail_json(d: overview.MachineDetail) -> dict[str, object]:
    return d.summary.to_json() | {
        "location": d.location,
        "agent_public_key": d.agent_public_key.hex() if d.agent_public_key else None,
        "hardware_report_bytes": d.hardware_report_bytes,
        "hardware_report": _hardware_json(d),
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


async def _history(conn: Connection, machine: str) -> str:
    machine_id = as_uuid(machine)

    async def fn(q: Queries) -> list[model.HistoryEvent]:
        return await q.history(machine_id)

    events = await conn.transact(fn, isolation=Isolation.REPEATABLE_READ)
    rows = [
        (when(e.at), str(e.process), str(e.event), str(e.session_id or "-"), e.cause or "")
        for e in events
    ]
    return table(("AT", "PROCESS", "EVENT", "SESSION", "CAUSE"), rows)


async def _sessions(conn: Connection) -> str:
    async def fn(q: Queries) -> list[model.SessionInfo]:
        return await q.sessions()

    sessions = await conn.transact(fn, isolation=Isolation.REPEATABLE_READ)
    rows = [
        (
            str(s.session_id),
            s.component,
            s.runtime_info,
            when(s.created_at),
            f"{s.interval:g}s",
            when(s.deadline),
            "expired" if s.expired else "live",
        )
        for s in sessions
    ]
    header = ("SESSION", "COMPONENT", "RUNTIME", "CREATED", "INTERVAL", "DEADLINE", "STATE")
    return table(header, rows)
