"""What the fleet's workers are doing: every session with its work locks,
and the last day's work outcomes per hour (the web UI's activity page).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.model import Queries, SessionInfo, WorkEvent
from bmdb.transaction import Isolation

_SESSIONS_SQL = """
SELECT session_id, session_component_name, session_runtime_info, session_created_at,
       session_interval_seconds, session_deadline, session_deadline <= now(),
       (SELECT count(*) FROM work w WHERE w.session_id = s.session_id)
FROM sessions s ORDER BY session_created_at, session_id
"""

# Work outcomes per hour over the last day (the history has no index on
# `at`: this scans it, fine for a page an operator opens now and then).
_OUTCOMES_SQL = """
SELECT date_trunc('hour', at), event, count(*) FROM work_history
WHERE at > now() - interval '24 hours' AND event <> 'Started'
GROUP BY 1, 2 ORDER BY 1, 2
"""


@dataclass(frozen=True, slots=True)
class SessionRow(SessionInfo):
    """A session and how many work locks it holds."""

    work: int


@dataclass(frozen=True)
class Activity:
    """Sessions, and work outcomes (Finished, Failed, Canceled) per hour."""

    sessions: list[SessionRow]
    #: (hour, event, count), oldest first.
    outcomes: list[tuple[datetime.datetime, WorkEvent, int]]


async def activity(conn: Connection) -> Activity:
    """Every session and the last 24 hours' work outcomes (two statements, one snapshot)."""

    async def body(q: Queries) -> tuple[list[Row], list[Row]]:
        return await q.execute(_SESSIONS_SQL), await q.execute(_OUTCOMES_SQL)

    sessions, outcomes = await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    return Activity(
        sessions=[SessionRow(*r) for r in sessions],
        outcomes=[(r[0], WorkEvent(r[1]), r[2]) for r in outcomes],
    )
