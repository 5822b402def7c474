"""The operators' actions on the web UI, read-only: the audit page, and the
section of a machine's page that shows its hold and the actions on it.

Actions are taken with ``python -m bmdb`` (`bmdb.actions`); this UI offers
none (it has no authentication), it only shows what the audit log holds.
Every text in it (operator names, reasons) went through `esc`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from bmdb import overview
from bmdb.connection import Connection
from bmdb.model import AuditRecord
from bmdb.overview import MachineDetail
from console.render import Html, ago, esc, link, page, table, url

#: Records per audit page.
PAGE_SIZE = 100

_COLUMNS = ("#", "at", "operator", "action", "machine", "reason", "what changed")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _rows(
    records: Sequence[AuditRecord], now: datetime.datetime, *, with_machine: bool
) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    for a in records:
        machine: object = (
            link(f"/machine/{a.machine_id}", a.machine_id, **{"class": "mono"})
            if a.machine_id
            else "-"
        )
        cells: tuple[object, ...] = (a.id, ago(a.at, now), a.operator, a.action)
        rows.append((*cells, *([machine] if with_machine else []), a.reason, a.detail))
    return rows


async def audit(conn: Connection, *, machine: str | None, before: int | None) -> Html:
    """The audit log, newest first, a page at a time (``before``: the
    records older than this id), optionally of one machine (also one that
    was forgotten since)."""
    records = await overview.audit(conn, machine=machine, limit=PAGE_SIZE + 1, before=before)
    more = len(records) > PAGE_SIZE
    records = records[:PAGE_SIZE]
    body = table(_COLUMNS, _rows(records, _now(), with_machine=True), empty="no actions")
    pager = [link(url("/audit", {"machine": machine}), "newest")]
    if more:
        pager.append(
            link(
                url("/audit", {"machine": machine, "before": records[-1].id}),
                "older",
                rel="next",
                id="next",
            )
        )
    note = Html(
        '<p class="dim">Operators act with <code>python -m bmdb</code> (hold, release, '
        "retry-now, forget-host-key, recover-now, forget-machine); this page only shows "
        "what they did.</p>"
    )
    title = "Audit log" + (f" of machine {machine}" if machine else "")
    content = Html(note + body + "<p>" + " | ".join(pager) + "</p>")
    return page(title, content, footer=f"{len(records)} shown")


def machine_section(d: MachineDetail) -> Html:
    """A machine page's hold, pending recovery request and operator actions."""
    hold = d.summary.hold
    if hold is not None:
        held = Html(
            f'<p class="state-failed">Held by {esc(hold.held_by)} since '
            f"{ago(hold.held_at, d.now)}: {esc(hold.reason)}. No process takes it until "
            "it is released.</p>"
        )
    else:
        held = Html('<p class="dim">Not held.</p>')
    if d.recovery_requested_by:
        held = Html(
            held + f"<p>Recovery requested by {esc(d.recovery_requested_by)} "
            f"{ago(d.recovery_requested_at, d.now)}.</p>"
        )
    if d.decommission:
        held = Html(held + f"<p>Decommission: {esc(d.decommission)}.</p>")
    header = tuple(c for c in _COLUMNS if c != "machine")
    rows = table(header, _rows(d.audit, d.now, with_machine=False), empty="no operator actions")
    more = link(url("/audit", {"machine": d.summary.machine_id}), "in the audit log")
    return Html(f"<h2>Operator actions ({len(d.audit)})</h2>{held}{rows}<p>{more}</p>")
