"""How the BMDB's command-line tool prints values: table cells, times, texts
from machines (control characters made visible, so that none can drive the
terminal or forge a row)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from common.text import printable

__all__ = ["left", "oneline", "table", "when"]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    # Cells hold text from machines (causes quote agents and SSH servers):
    # escaped, so that none can drive the terminal or forge a row.
    rows = [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]
    return "\n".join(lines)


def when(at: datetime.datetime | None) -> str:
    return at.isoformat(timespec="seconds") if at else "-"


def oneline(text: str | None) -> str:
    """A database text as one table cell: control characters made visible."""
    if not text:
        return "-"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def left(until: datetime.datetime | None, now: datetime.datetime) -> str:
    """``until`` and the time left to it, e.g. ``2026-01-02T03:04:05+00:00 (4m05s)``."""
    if until is None:
        return "-"
    seconds = max(0, int((until - now).total_seconds()))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    left = f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
    return f"{when(until)} ({left})"
