"""The web UI's pages as Jinja2 templates (``console/templates``), compiled once
and autoescaped.

Markup is written only in the templates. Everything a page function hands
them (texts from the database, ids, errors, parameters) is data, and every
``{{ ... }}`` escapes it: markupsafe's escape of ``& < > " '``, so a text
is inert in element content and in a quoted attribute alike. Nothing in
Python returns markup, so nothing can skip the escape by being mistaken for
it.

A page function returns a `Page` (its template, title, footer and the data
the template shows); the ASGI app renders it with `render`, adding what
every page shows (the navigation, the standby note). The filters and
globals registered here compute texts (relative times, URLs, durations),
never markup.

The templates are compiled to Python functions when this module is
imported and kept for the life of the process (`auto_reload` off: they
ship with the package and do not change under a running server).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import jinja2

__all__ = ["ENV", "Page", "ago", "duration", "render", "time_left", "url"]


@dataclass(frozen=True)
class Page:
    """A page to render: ``template`` (a file in ``console/templates``) with
    ``context``; ``title`` heads it (and names the browser tab), ``footer``
    closes it."""

    template: str
    title: str
    context: Mapping[str, Any] = field(default_factory=dict)
    footer: str = ""


def url(path: str, params: Mapping[str, object | None]) -> str:
    """``path`` with the non-empty ``params`` as a query string."""
    return _url(path, tuple((k, str(v)) for k, v in params.items() if v not in (None, "")))


@functools.lru_cache(maxsize=1024)
def _url(path: str, params: tuple[tuple[str, str], ...]) -> str:
    # Cached: the machine list links 16 filters, the same ones page after
    # page, and urlencode costs more than the rest of the page's links.
    query = urlencode(params)
    return f"{path}?{query}" if query else path


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def ago(at: datetime.datetime, now: datetime.datetime) -> str:
    """A time relative to ``now``: "3m00s ago" or "in 5m00s"."""
    seconds = (at - now).total_seconds()
    text = duration(abs(seconds))
    return f"in {text}" if seconds > 0 else f"{text} ago"


def iso(at: datetime.datetime) -> str:
    """A time as ISO 8601, as HTML's ``<time datetime>`` takes it."""
    return at.isoformat()


def time_left(until: datetime.datetime, now: datetime.datetime) -> str:
    """How long from ``now`` until ``until``: "5m00s", "0s" once past."""
    return duration(max(0.0, (until - now).total_seconds()))


#: The pages' links in the header of every page.
NAV = (
    ("/machines", "Machines"),
    ("/sessions", "Sessions"),
    ("/audit", "Audit"),
    ("/cluster", "Cluster"),
)

ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("console", "templates"),
    # Every template is HTML: escape every value, whatever the file's name.
    autoescape=True,
    # A name a template misspells is an error (a 500 and a failing test),
    # not an empty string on the page.
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    auto_reload=False,
    # Every template stays compiled: there are a dozen.
    cache_size=-1,
)
ENV.filters["ago"] = ago
ENV.filters["iso"] = iso
ENV.filters["duration"] = duration
ENV.filters["time_left"] = time_left
ENV.globals.update(NAV=NAV)

# Compiled now, once: the first request of each page pays nothing for it,
# and a template that does not compile fails the import (and every test).
_TEMPLATES = {name: ENV.get_template(name) for name in ENV.list_templates()}


def render(page: Page, *, standby: str | None = None) -> str:
    """``page`` as an HTML document; ``standby``: a note that the page was
    read from a standby, shown above its title. Raises what the template
    raises (a bug: `jinja2.TemplateError`, or the error of a value it reads)."""
    return _TEMPLATES[page.template].render(
        page.context, title=page.title, footer=page.footer, standby=standby
    )
