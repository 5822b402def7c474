"""HTML building blocks for the web UI. Every text from the database goes
through `esc`; markup is only ever built here from escaped parts.

`Html` marks strings that are already markup, so that helpers escape
everything else they are given and never escape twice.
"""

from __future__ import annotations

import datetime
import html
import re
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlencode


class Html(str):
    """A string of markup, safe to emit as is."""

    __slots__ = ()


# The characters `html.escape` replaces (quote=True): a text without any is
# its own escape, and one search is cheaper than escape's five replaces (a
# machine list page escapes about 1,900 texts).
_SPECIAL = re.compile("[&<>\"']")


def esc(value: object) -> Html:
    """``value`` as text in HTML (quotes too, so it is safe in attributes)."""
    if isinstance(value, Html):
        return value
    text = "" if value is None else str(value)
    if _SPECIAL.search(text) is None:
        return Html(text)
    return Html(html.escape(text, quote=True))


def join(parts: Iterable[object]) -> Html:
    return Html("".join(esc(p) for p in parts))


def link(href: str, text: object, **attrs: str) -> Html:
    extra = "".join(f' {k}="{esc(v)}"' for k, v in attrs.items())
    return Html(f'<a href="{esc(href)}"{extra}>{esc(text)}</a>')


def url(path: str, params: Mapping[str, object | None]) -> str:
    """``path`` with the non-empty ``params`` as a query string."""
    query = urlencode({k: str(v) for k, v in params.items() if v not in (None, "")})
    return f"{path}?{query}" if query else path


def table(header: Sequence[str], rows: Iterable[Sequence[object]], *, empty: str = "none") -> Html:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        body = f'<tr><td colspan="{len(header)}" class="dim">{esc(empty)}</td></tr>'
    return Html(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def fields(items: Sequence[tuple[str, object]]) -> Html:
    """A two-column table of name, value."""
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in items)
    return Html(f'<table class="fields">{rows}</table>')


def ago(at: datetime.datetime | None, now: datetime.datetime) -> Html:
    """A time as "3m ago" / "in 5m", the exact time on hover."""
    if at is None:
        return Html('<span class="dim">-</span>')
    seconds = (at - now).total_seconds()
    text = duration(abs(seconds))
    rel = f"in {text}" if seconds > 0 else f"{text} ago"
    exact = esc(at.isoformat())
    return Html(f'<time datetime="{exact}" title="{exact}">{rel}</time>')


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


_STYLE = """
body{font:13px/1.35 system-ui,sans-serif;margin:0;color:#111}
header{background:#223;color:#fff;padding:4px 10px}header a{color:#fff;margin-right:14px}
main{padding:6px 10px}h1{font-size:16px;margin:6px 0}h2{font-size:14px;margin:12px 0 4px}
table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:1px 6px;
text-align:left;vertical-align:top;white-space:pre-wrap}th{background:#f3f3f6}
.fields th{width:14em}.dim{color:#888}.state-failed{color:#b00;font-weight:bold}
.filters a{margin-right:8px}.filters a.on{font-weight:bold;text-decoration:none}
code,.mono{font-family:ui-monospace,monospace}.state-healthy{color:#2a7}
.state-backoff{color:#b00;font-weight:bold}.leader{color:#26a}
.state-install-failed,.state-install-lost{color:#b00;font-weight:bold}.state-installed{color:#2a7}
.state-installing{color:#59d}
"""

NAV = (
    ("/machines", "Machines"),
    ("/sessions", "Sessions"),
    ("/audit", "Audit"),
    ("/cluster", "Cluster"),
)


def page(title: str, body: Html, *, footer: str = "") -> Html:
    nav = "".join(link(href, text) for href, text in NAV)
    return Html(
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>{esc(title)} - BMDB</title><style>{_STYLE}</style></head>"
        f"<body><header>{nav}</header><main><h1>{esc(title)}</h1>{body}"
        f'<p class="dim">{esc(footer)}</p></main></body></html>'
    )


#: Colours of the chart series (by name), fixed so charts read alike.
COLOURS = {
    "Finished": "#2a7",
    "Failed": "#c33",
    "Canceled": "#999",
    "failed": "#c33",
    "unprovided": "#bbb",
    "needs-agent-start": "#e90",
    "started": "#59d",
    "heartbeating": "#2a7",
    "silent": "#737",
    "decommissioned": "#555",
}


def stacked_bar(counts: Sequence[tuple[str, int]], *, width: int = 600) -> Html:
    """One horizontal bar split by ``counts`` (name, count), with a legend."""
    total = sum(c for _, c in counts) or 1
    x = 0.0
    rects = []
    for name, count in counts:
        w = width * count / total
        rects.append(
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="14" '
            f'fill="{COLOURS.get(name, "#555")}"><title>{esc(name)}: {count}</title></rect>'
        )
        x += w
    legend = " ".join(
        f'<span style="color:{COLOURS.get(n, "#555")}">&#9632;</span> {esc(n)} {c}'
        for n, c in counts
    )
    svg = f'<svg width="{width}" height="14" role="img">{"".join(rects)}</svg>'
    return Html(f"<div>{svg}</div><div>{legend}</div>")


def columns(
    buckets: Sequence[str], series: Mapping[str, Sequence[int]], *, height: int = 80
) -> Html:
    """Stacked columns, one per bucket (e.g. hour), one colour per series."""
    peak = max((sum(v[i] for v in series.values()) for i in range(len(buckets))), default=0)
    scale = height / (peak or 1)
    bar = 14
    parts = []
    for i, bucket in enumerate(buckets):
        y = float(height)
        for name, values in series.items():
            h = values[i] * scale
            if h:
                y -= h
                parts.append(
                    f'<rect x="{i * (bar + 2)}" y="{y:.1f}" width="{bar}" height="{h:.1f}" '
                    f'fill="{COLOURS.get(name, "#555")}"><title>{esc(bucket)} {esc(name)}: '
                    f"{values[i]}</title></rect>"
                )
    width = max(1, len(buckets)) * (bar + 2)
    legend = " ".join(
        f'<span style="color:{COLOURS.get(n, "#555")}">&#9632;</span> {esc(n)} {sum(v)}'
        for n, v in series.items()
    )
    svg = f'<svg width="{width}" height="{height}" role="img">{"".join(parts)}</svg>'
    return Html(f"<div>{svg}</div><div>{legend} (peak {peak}/h)</div>")
