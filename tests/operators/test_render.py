"""`console.render`'s escaping: every text from the database becomes inert markup."""

from __future__ import annotations

import datetime
import html

import pytest

from console.render import Html, ago, esc, link, table


@pytest.mark.parametrize(
    "text",
    ["<script>alert(1)</script>", 'a "quoted" value', "it's", "R&D", "x>y", "plain text", ""],
)
def test_esc_is_html_escape_with_quotes(text: str) -> None:
    assert esc(text) == html.escape(text, quote=True)
    assert isinstance(esc(text), Html)


def test_esc_leaves_markup_and_renders_none_and_objects() -> None:
    markup = Html("<b>bold</b>")
    assert esc(markup) is markup
    assert esc(None) == ""
    assert esc(42) == "42"


def test_hostile_cells_links_and_times_cannot_open_a_tag() -> None:
    evil = "\"><img src=x onerror=alert(1)>'"
    out = table(["h<"], [[evil, link(f"/m/{evil}", evil, title=evil)]])
    assert "<img" not in out and "&lt;img" in out
    assert "<th>h&lt;</th>" in out
    at = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    stamp = ago(at, at + datetime.timedelta(seconds=90))
    assert stamp == (
        '<time datetime="2026-01-02T03:04:05+00:00" title="2026-01-02T03:04:05+00:00">'
        "1m30s ago</time>"
    )
