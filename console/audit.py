"""The operators' actions on the web UI, read-only: the audit page
(``templates/audit.html``); a machine's page shows its hold and the actions
on it (``templates/actions.html``).

Actions are taken with ``python -m bmdb`` (`bmdb.actions`); this UI offers
none (it has no authentication), it only shows what the audit log holds.
Every text in it (operator names, reasons) is escaped by the templates.
"""

from __future__ import annotations

import datetime

from bmdb import overview
from bmdb.connection import Connection
from console.render import Page, url

#: Records per audit page.
PAGE_SIZE = 100


async def audit(conn: Connection, *, machine: str | None, before: int | None) -> Page:
    """The audit log, newest first, a page at a time (``before``: the
    records older than this id), optionally of one machine (also one that
    was forgotten since)."""
    records = await overview.audit(conn, machine=machine, limit=PAGE_SIZE + 1, before=before)
    more = len(records) > PAGE_SIZE
    records = records[:PAGE_SIZE]
    older = url("/audit", {"machine": machine, "before": records[-1].id}) if more else None
    title = "Audit log" + (f" of machine {machine}" if machine else "")
    return Page(
        "audit.html",
        title,
        {
            "records": records,
            "now": datetime.datetime.now(datetime.UTC),
            "newest": url("/audit", {"machine": machine}),
            "older": older,
        },
        footer=f"{len(records)} shown",
    )
