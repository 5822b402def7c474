"""The templates' escaping (`console.render`): every text a page shows is inert.

The pages are rendered with hostile texts in the places the database, the
cluster or a request fills, and the output is parsed as a browser's
tokenizer would: no element or attribute the texts spell appears, and
every text reads back as it was. (The BMDB pages are also checked in
Chromium against real PostgreSQL rows: `test_web`, `test_audit_web`,
`test_install_views`, `test_hostile_web`.)
"""

from __future__ import annotations

import datetime
import html
from html.parser import HTMLParser

import pytest
import trio

import bmdb
from console import asgi, cluster
from console.counts import CountsCache
from console.render import ENV, NAV, Page, render
from metropolis.owner import NodeRow
from metropolis.proto import management as m

#: Closes an attribute's quotes (both kinds) and the tag, opens elements
#: with handlers, and carries an entity and a raw ampersand.
EVIL = "\"'><script>alert(1)</script><img src=x onerror=alert(1)>&amp; &<b>bold</b>"

#: Elements only the texts could have made.
FORBIDDEN = {"script", "img", "b"}


class _Parsed(HTMLParser):
    """Tags, attributes and text of a document (entities decoded)."""

    def __init__(self, document: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str | None]] = []
        self.texts: list[str] = []
        self.feed(document)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes += attrs

    def handle_data(self, data: str) -> None:
        self.texts.append(data)

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _inert(document: str, shown: int) -> _Parsed:
    """``document`` holds no element or handler the hostile text spells and
    shows it, as text, at least ``shown`` times."""
    parsed = _Parsed(document)
    assert FORBIDDEN.isdisjoint(parsed.tags), parsed.tags
    assert not [name for name, _ in parsed.attributes if name.startswith("on")]
    assert parsed.text.count(EVIL) >= shown, parsed.text
    return parsed


def test_every_template_compiles_with_autoescape_and_strict_names() -> None:
    names = ENV.list_templates()
    assert {"base.html", "machines.html", "machine.html", "error.html"} <= set(names)
    assert ENV.autoescape is True
    for name in names:
        assert ENV.get_template(name).environment is ENV
    # A name no page defines is an error, not an empty string on the page.
    with pytest.raises(Exception, match="'text' is undefined"):
        render(Page("error.html", "t"))


def test_title_footer_standby_note_and_error_text_are_text() -> None:
    document = render(Page("error.html", EVIL, {"text": EVIL}, footer=EVIL), standby=EVIL)
    parsed = _inert(document, shown=4)  # the <h1>, the error, the footer, the note
    title = document.split("<title>", 1)[1].split("</title>", 1)[0]
    assert "<" not in title and html.unescape(title) == f"{EVIL} - BMDB"
    assert parsed.tags.count("a") == len(NAV)


def test_an_apostrophe_and_a_quote_cannot_leave_an_attribute() -> None:
    # A machine id is a UUID by the time it is linked, but the href and the
    # class quote whatever they are given.
    macro = ENV.from_string(
        '{% from "macros.html" import machine_link %}{{ machine_link(id, css=css) }}'
    )
    document = macro.render(id=EVIL, css=EVIL)
    parsed = _inert(document, shown=1)
    assert parsed.attributes == [("href", f"/machine/{EVIL}"), ("class", EVIL)]


def test_ago_writes_an_exact_time_and_a_relative_one() -> None:
    macro = ENV.from_string('{% from "macros.html" import ago %}{{ ago(at, now) }}')
    at = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert macro.render(at=at, now=at + datetime.timedelta(seconds=90)) == (
        '<time datetime="2026-01-02T03:04:05+00:00" title="2026-01-02T03:04:05+00:00">'
        "1m30s ago</time>"
    )
    assert macro.render(at=at, now=at - datetime.timedelta(hours=2)) == (
        '<time datetime="2026-01-02T03:04:05+00:00" title="2026-01-02T03:04:05+00:00">'
        "in 2h00m</time>"
    )
    assert macro.render(at=None, now=at) == '<span class="dim">-</span>'


def _node(text: str) -> NodeRow:
    return NodeRow(
        node_id=text,
        public_key=bytes(32),
        address=text,
        state=text,
        roles=(text, text),
        curator=True,
        debug_port=7835,
        health=text,
        since_heartbeat=3.0,
    )


def test_cluster_pages_show_what_the_cluster_says_as_text() -> None:
    """What a curator or a node answers (ids, addresses, states, roles,
    runnable names, errors) and what the BMDB says instead of machines."""
    nodes = Page(
        "cluster_nodes.html",
        "Cluster nodes",
        {"curators": [EVIL], "rows": [_node(EVIL)], "machines": f"BMDB: {EVIL}"},
    )
    _inert(render(nodes), shown=8)
    node = Page("cluster_node.html", "Node", {"row": _node(EVIL), "machines": {}})
    _inert(render(node), shown=5)

    answer = m.GetSupervisionTreeResponse(
        node_id=EVIL,
        runnables=[
            m.SupervisedRunnable(
                name=EVIL,
                state=m.SupervisedRunnableState.BACKOFF,
                restarts=3,
                last_error=EVIL,
                last_error_at=datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC),
            )
        ],
    )
    document = render(cluster._tree_page(EVIL, EVIL, answer))
    _inert(document, shown=6)  # title twice, node, address, name, error
    assert '<span class="state-failed">BACKOFF</span>' in document

    gone = cluster._Unreachable(EVIL, [EVIL, EVIL], EVIL)
    _inert(render(cluster._unreachable_page(EVIL, gone)), shown=5)


def test_an_error_page_says_what_was_asked_for_as_text() -> None:
    document = render(asgi._error("Not found", f"No page at /{EVIL}."))
    _inert(document, shown=1)


async def test_a_page_that_fails_to_render_is_a_500_page_and_logged(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A template bug (here: a page without the value its template shows)
    answers 500 with the error page, and the traceback goes to the log."""

    class Broken(asgi.App):
        async def _respond(self, scope: asgi.Scope) -> tuple[int, Page]:
            return 200, Page("error.html", "Broken")

    sent: list[asgi.Message] = []

    async def send(message: asgi.Message) -> None:
        sent.append(message)

    async def receive() -> asgi.Message:
        raise AssertionError("a GET has no body to read")

    app = Broken(bmdb_conn, CountsCache(bmdb_conn, nursery))
    scope = {"type": "http", "method": "GET", "path": "/broken", "query_string": b""}
    await app(scope, receive, send)
    assert sent[0]["status"] == 500
    body = sent[1]["body"].decode()
    assert "<h1>Internal error</h1>" in body and "See the server&#39;s log." in body
    assert "'text' is undefined" in caplog.text and "rendering GET /broken failed" in caplog.text
