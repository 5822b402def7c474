"""What happened and who works: a machine's work history, the operators'
audit log for actions not on one machine's row, the sessions and their
work rows, and machine summaries.

What tools, tests and the CLI read back of the BMDB's bookkeeping; the
operators' views (`bmdb.overview`) read the same tables for their pages.
"""

from __future__ import annotations

import uuid

from bmdb.model import rows as records
from bmdb.model.base import QueriesBase
from bmdb.model.checks import as_uuid, check_limit, check_text
from bmdb.model.enums import Process, WorkEvent
from bmdb.model.machines import PROVIDED_COLUMNS, provided_from_row

#: The machine's whole work history, oldest first (the machine page reads
#: it too, `bmdb.overview`).
HISTORY_SQL = """
SELECT machine_id, process, event, at, session_id, cause FROM work_history
WHERE machine_id = %s ORDER BY id
"""


class HistoryQueries(QueriesBase):
    """Work history, the audit log's appends, sessions, work rows and
    machine summaries."""

    async def history(self, machine_id: uuid.UUID | str) -> list[records.HistoryEvent]:
        """The machine's work history, oldest first."""
        rows = await self.execute(HISTORY_SQL, (as_uuid(machine_id),))
        return [
            records.HistoryEvent(
                machine_id=r[0],
                process=Process(r[1]),
                event=WorkEvent(r[2]),
                at=r[3],
                session_id=r[4],
                cause=r[5],
            )
            for r in rows
        ]

    async def append_audit(
        self, operator: str, action: str, machine_id: uuid.UUID | None, reason: str, detail: str
    ) -> int:
        """Append an audit record (for actions not on one machine's row, such as
        an upgrade run); its id. The table's CHECKs refuse an empty operator or
        reason and an action name that is not lower-case words."""
        for name, value in (("operator", operator), ("reason", reason), ("detail", detail)):
            check_text(name, value)
        rows = await self.execute(
            """INSERT INTO audit_log (operator, action, machine_id, reason, detail)
               VALUES (%s, %s, %s, %s, %s) RETURNING id""",
            (operator, action, machine_id, reason, detail),
        )
        return int(rows[0][0])

    async def sessions(self) -> list[records.SessionInfo]:
        """Every session row, including expired ones not yet collected."""
        rows = await self.execute(
            """SELECT session_id, session_component_name, session_runtime_info,
                      session_created_at, session_interval_seconds, session_deadline,
                      session_deadline <= now()
               FROM sessions ORDER BY session_created_at, session_id"""
        )
        return [records.SessionInfo(*r) for r in rows]

    async def work(self) -> list[records.WorkInfo]:
        """Every work row (live or stale)."""
        rows = await self.execute("SELECT machine_id, process, session_id FROM work ORDER BY 1, 2")
        return [records.WorkInfo(r[0], Process(r[1]), r[2]) for r in rows]

    async def machines(self, limit: int = 1000) -> list[records.MachineSummary]:
        """Machines with their tags, oldest first."""
        rows = await self.execute(
            f"""SELECT m.machine_id, m.machine_created_at, a.agent_started_at,
                       h.agent_heartbeat_at, r.machine_id IS NOT NULL,
                       ARRAY(SELECT w.process::text FROM work w
                             WHERE w.machine_id = m.machine_id ORDER BY 1),
                       p.machine_id IS NOT NULL, {PROVIDED_COLUMNS}
                FROM machines m
                LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
                LEFT JOIN machine_agent_started a ON a.machine_id = m.machine_id
                LEFT JOIN machine_agent_heartbeat h ON h.machine_id = m.machine_id
                LEFT JOIN machine_hardware_report r ON r.machine_id = m.machine_id
                ORDER BY m.machine_created_at, m.machine_id
                LIMIT %s""",
            (check_limit(limit),),
        )
        return [
            records.MachineSummary(
                machine_id=r[0],
                created_at=r[1],
                agent_started_at=r[2],
                agent_heartbeat_at=r[3],
                has_hardware_report=r[4],
                work=tuple(Process(w) for w in r[5]),
                provided=provided_from_row(r[7:]) if r[6] else None,
            )
            for r in rows
        ]
