"""The operators' audit log, newest first: every action an operator took
(`bmdb.actions`), of one machine or all, a page at a time.
"""

from __future__ import annotations

import uuid

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.errors import InvalidArgument
from bmdb.model import AuditRecord, Queries, as_uuid
from bmdb.transaction import Isolation

#: Operators' actions, newest first, optionally of one machine, before an id.
AUDIT_SQL = """
SELECT id, at, operator, action, machine_id, reason, detail FROM audit_log
WHERE (%(machine)s::uuid IS NULL OR machine_id = %(machine)s::uuid)
  AND (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s
"""


#: The most audit records one call returns (a machine's page shows its newest).
MAX_AUDIT = 1000


async def audit(
    conn: Connection,
    *,
    machine: uuid.UUID | str | None = None,
    limit: int = 100,
    before: int | None = None,
) -> list[AuditRecord]:
    """Operators' actions, newest first: up to ``limit`` (at most
    `MAX_AUDIT`) records with an id below ``before``, of one machine or all
    (a forgotten machine's records included)."""
    if not isinstance(limit, int) or not 1 <= limit <= MAX_AUDIT:
        raise InvalidArgument(f"limit must be 1 to {MAX_AUDIT}, got {limit!r}")
    if before is not None and (not isinstance(before, int) or before < 1):
        raise InvalidArgument(f"before must be a positive record id, got {before!r}")
    params = {
        "machine": None if machine is None else as_uuid(machine),
        "before": before,
        "limit": limit,
    }

    async def body(q: Queries) -> list[Row]:
        return await q.execute(AUDIT_SQL, params)

    rows = await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    return [AuditRecord(*r) for r in rows]
