"""One machine's page: everything the BMDB knows of it (``bmdb machine``,
the web UI's machine page), read in one snapshot.

Its listing line (`bmdb.overview.listing`) with every other tag, its work
and backoffs, its installation, its history, the operators' actions on it
(`bmdb.overview.auditlog`), a requested recovery or decommission, and its
hardware report decoded (bounded by `MAX_HARDWARE_REPORT`).
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.model import (
    AuditRecord,
    HistoryEvent,
    OSInstallation,
    Process,
    Queries,
    as_uuid,
)
from bmdb.model.installs import INSTALLATION_COLUMNS, INSTALLATION_WIDTH, installation_from_row
from bmdb.overview.auditlog import AUDIT_SQL, MAX_AUDIT
from bmdb.overview.listing import (
    SUMMARY_COLUMNS,
    MachineState,
    all_machines_sql,
    machine_state_from_row,
)
from bmdb.transaction import Isolation

if TYPE_CHECKING:
    from common.hwreport import HardwareReport


@dataclass(frozen=True)
class WorkRow:
    """A work lock on the machine, with its session."""

    process: Process
    session_id: uuid.UUID
    component: str
    live: bool


@dataclass(frozen=True)
class BackoffRow:
    """A stored backoff of the machine (possibly over already)."""

    process: Process
    until: datetime.datetime
    cause: str
    interval_seconds: int
    active: bool


@dataclass(frozen=True)
class MachineDetail:
    """Everything the BMDB knows about one machine."""

    summary: MachineState
    location: str | None
    agent_public_key: bytes | None
    hardware_report_bytes: int | None
    os_installation_request_generation: int | None
    os_installation_report_generation: int | None
    ssh_host_key: bytes | None
    ssh_host_key_first_seen: datetime.datetime | None
    #: The installation request and the report on it, None without a request.
    installation: OSInstallation | None
    work: tuple[WorkRow, ...]
    backoffs: tuple[BackoffRow, ...]
    history: tuple[HistoryEvent, ...]
    #: The database's clock when this was read (for "time left").
    now: datetime.datetime
    #: Operators' actions on the machine, oldest first (`bmdb.actions`).
    audit: tuple[AuditRecord, ...] = ()
    #: Who asked for a recovery not done yet (``recover-now``), and when.
    recovery_requested_by: str | None = None
    recovery_requested_at: datetime.datetime | None = None
    #: How far a requested decommission got, in one line; None if none was.
    decommission: str | None = None
    #: The stored hardware report decoded (`common.hwreport`); None without
    #: one, or when it does not decode.
    hardware: HardwareReport | None = None
    #: Why a stored report is not in `hardware`: it does not decode (old,
    #: cut short, hostile), or is larger than `MAX_HARDWARE_REPORT`.
    hardware_unreadable: str | None = None


#: Largest stored hardware report read and decoded, bytes: four times the
#: largest heartbeat the agent callback server takes (256 KiB), so that a
#: report any server stored is read, and a row written otherwise cannot make
#: a page read a gigabyte.
MAX_HARDWARE_REPORT = 1024 * 1024


# One machine: its `machines_sql` line and every other tag, its work and
# backoffs as JSON arrays (one row, however many of them).
DETAIL_SQL = f"""
SELECT v.*, p.provider_location, a.agent_public_key, octet_length(r.hardware_report_raw),
       oq.generation, orp.generation, k.public_key, k.first_seen,
       oq.machine_id IS NOT NULL, {INSTALLATION_COLUMNS},
       (SELECT coalesce(json_agg(json_build_array(w.process, w.session_id,
                                                  s.session_component_name,
                                                  s.session_deadline > now())
                                 ORDER BY w.process), '[]')
        FROM work w JOIN sessions s ON s.session_id = w.session_id
        WHERE w.machine_id = v.machine_id),
       (SELECT coalesce(json_agg(json_build_array(b.process, b.until, b.cause,
                                                  b.last_interval_seconds, b.until > now())
                                 ORDER BY b.process), '[]')
        FROM work_backoff b WHERE b.machine_id = v.machine_id),
       now(), rr.requested_by, rr.requested_at,
       CASE WHEN dc.machine_id IS NULL THEN NULL
            WHEN dc.decommissioned_at IS NOT NULL
                 THEN 'decommissioned (a tombstone) at ' || dc.decommissioned_at
                      || coalesce('; node ' || dc.node_id || ' ' || dc.node_removal, '')
                      || '; wiped: ' || dc.wipe_report || '; ' || dc.release_detail
            WHEN dc.released_at IS NOT NULL THEN 'released: ' || dc.release_detail
            WHEN dc.wiped_at IS NOT NULL THEN 'wiped at ' || dc.wiped_at || ': ' || dc.wipe_report
            WHEN dc.node_removed_at IS NOT NULL
                 THEN 'node ' || dc.node_id || ' at ' || dc.node_removed_at || ': '
                      || dc.node_removal || '; not wiped yet'
            ELSE 'requested by ' || dc.requested_by || ' at ' || dc.requested_at
                 || ' (' || dc.reason || '), not wiped yet' END,
       CASE WHEN octet_length(r.hardware_report_raw) <= %(max_report)s
            THEN r.hardware_report_raw END
FROM ({all_machines_sql()}) v
LEFT JOIN machine_provided p ON p.machine_id = v.machine_id
LEFT JOIN machine_agent_started a ON a.machine_id = v.machine_id
LEFT JOIN machine_hardware_report r ON r.machine_id = v.machine_id
LEFT JOIN machine_os_installation_request oq ON oq.machine_id = v.machine_id
LEFT JOIN machine_os_installation_report orp ON orp.machine_id = v.machine_id
LEFT JOIN machine_ssh_host_key k ON k.machine_id = v.machine_id
LEFT JOIN machine_recovery_request rr ON rr.machine_id = v.machine_id
LEFT JOIN machine_decommission dc ON dc.machine_id = v.machine_id
WHERE v.machine_id = %(machine)s
"""


def detail_params(machine_id: uuid.UUID) -> dict[str, object]:
    """`DETAIL_SQL`'s parameters for one machine."""
    return {"machine": machine_id, "max_report": MAX_HARDWARE_REPORT}


async def machine(conn: Connection, machine_id: uuid.UUID | str) -> MachineDetail | None:
    """Everything about one machine (three statements, one snapshot), or None
    if there is no such machine. `InvalidArgument` if ``machine_id`` is not a UUID."""
    mid = as_uuid(machine_id)
    params = detail_params(mid)
    audit_params = {"machine": mid, "before": None, "limit": MAX_AUDIT}

    async def body(q: Queries) -> tuple[list[Row], list[HistoryEvent], list[Row]]:
        return (
            await q.execute(DETAIL_SQL, params),
            await q.history(mid),
            await q.execute(AUDIT_SQL, audit_params),
        )

    rows, history, audit_rows = await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    if not rows:
        return None
    r = rows[0]
    extra = r[SUMMARY_COLUMNS:]
    installation = installation_from_row(extra[8 : 8 + INSTALLATION_WIDTH]) if extra[7] else None
    extra = extra[:7] + extra[8 + INSTALLATION_WIDTH :]
    hardware, unreadable = _hardware(extra[2], extra[13])
    return MachineDetail(
        summary=machine_state_from_row(r[:SUMMARY_COLUMNS]),
        location=extra[0],
        agent_public_key=None if extra[1] is None else bytes(extra[1]),
        hardware_report_bytes=extra[2],
        os_installation_request_generation=extra[3],
        os_installation_report_generation=extra[4],
        ssh_host_key=None if extra[5] is None else bytes(extra[5]),
        ssh_host_key_first_seen=extra[6],
        installation=installation,
        work=tuple(WorkRow(Process(w[0]), uuid.UUID(w[1]), w[2], w[3]) for w in _json(extra[7])),
        backoffs=tuple(
            BackoffRow(Process(b[0]), datetime.datetime.fromisoformat(b[1]), b[2], b[3], b[4])
            for b in _json(extra[8])
        ),
        history=tuple(history),
        now=extra[9],
        audit=tuple(AuditRecord(*a) for a in reversed(audit_rows)),
        recovery_requested_by=extra[10],
        recovery_requested_at=extra[11],
        decommission=extra[12],
        hardware=hardware,
        hardware_unreadable=unreadable,
    )


def _hardware(size: int | None, raw: bytes | None) -> tuple[HardwareReport | None, str | None]:
    """A stored report of ``size`` bytes (``raw`` if read) decoded, or why not."""
    # Imported here: only a machine's detail decodes a report.
    from common.hwreport import decode

    if size is None:
        return None, None
    if raw is None:
        return None, f"{size} bytes, over the {MAX_HARDWARE_REPORT} this view reads"
    try:
        return decode(bytes(raw)), None
    except ValueError as exc:
        return None, f"{exc} ({size} bytes)"


def _json(value: Any) -> Sequence[Any]:
    # psycopg loads json columns already; a str means a text loader was used.
    loaded = json.loads(value) if isinstance(value, str) else value
    assert isinstance(loaded, list)
    return loaded
