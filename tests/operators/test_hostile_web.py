"""Texts no operator expects, in BMDB rows and in requests, on the web UI:
huge, full of markup, control characters and bidi overrides, in real
PostgreSQL rows; requests whose bytes are not UTF-8. Each page answers
with the text as text, and the server goes on serving."""

from __future__ import annotations

import socket
import uuid
from html.parser import HTMLParser

import httpx
import pytest
import trio
from playwright.async_api import BrowserContext

import bmdb
from bmdb import Backoff, Process, Provider, Queries
from console.server import serve
from tests.operators.browser import Chromium

#: Markup of every kind a text could try (elements, a comment, CDATA, an
#: attribute break-out), control characters, a right-to-left override, a
#: line separator, an emoji and a combining mark.
STRANGE = (
    "<script>alert(1)</script><img src=x onerror=alert(2)><iframe src=//x></iframe>"
    "<!-- --><![CDATA[x]]></textarea></td></tr></table>\"'><svg onload=alert(3)>"
    "\x01\x08\x0b\x1b[31m\u202egnirts\u202c\u2028\U0001f525e\u0301 &amp; &lt;"
)
#: A failure cause of a mebibyte (a tool's whole output pasted into it).
HUGE_CAUSE = (STRANGE * (1 + 2**20 // len(STRANGE)))[: 2**20]
#: A provider id as long as its unique index allows (about 2.7 kB a row).
LONG_PROVIDER_ID = (STRANGE * 20)[:2000]

#: Elements only the texts could have made, were they markup.
FORBIDDEN = {"script", "img", "iframe", "textarea"}


class _Parsed(HTMLParser):
    """A document's start tags and text (entities decoded)."""

    def __init__(self, document: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.handlers: list[str] = []
        self.texts: list[str] = []
        self.feed(document)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.handlers += [name for name, _ in attrs if name.startswith("on")]

    def handle_data(self, data: str) -> None:
        self.texts.append(data)


def _inert(document: str, *texts: str) -> None:
    parsed = _Parsed(document)
    assert FORBIDDEN.isdisjoint(parsed.tags), sorted(FORBIDDEN & set(parsed.tags))
    assert parsed.handlers == []
    shown = "".join(parsed.texts)
    for text in texts:
        assert text in shown


@pytest.fixture
async def strange_machine(bmdb_conn: bmdb.Connection) -> uuid.UUID:
    """A failed machine whose provider id, address and failure cause are
    `LONG_PROVIDER_ID`, `STRANGE` and `HUGE_CAUSE`."""

    async def make(q: Queries) -> uuid.UUID:
        mid = await q.new_machine()
        await q.add_provided(mid, Provider.STATIC, LONG_PROVIDER_ID, STRANGE)
        return mid

    mid = await bmdb_conn.transact(make)
    async with bmdb_conn.session("test-hostile", "pytest") as sess:

        async def source(q: Queries) -> list[uuid.UUID]:
            return [mid]

        work = await sess.work(Process.SHEPHERD_AGENT_START, source)
        await work.fail(HUGE_CAUSE, Backoff(initial=3600))
    return mid


async def test_huge_and_strange_texts_in_rows_are_shown_as_text(
    bmdb_conn: bmdb.Connection,
    nursery: trio.Nursery,
    strange_machine: uuid.UUID,
    chromium: Chromium,
) -> None:
    [web] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")
    async with httpx.AsyncClient(base_url=web, timeout=60) as client:
        for path in ("/machines", "/machines?state=failed", f"/machine/{strange_machine}"):
            r = await client.get(path)
            assert r.status_code == 200, path
            _inert(r.text, LONG_PROVIDER_ID, STRANGE, HUGE_CAUSE)

    async def scenario(context: BrowserContext) -> None:
        page = await context.new_page()
        dialogs: list[str] = []
        page.on("dialog", lambda d: dialogs.append(d.message))
        await page.goto(f"{web}/machines?state=failed")
        await page.get_by_role("link", name=str(strange_machine)).click()
        await page.wait_for_url(f"**/machine/{strange_machine}")
        fields = await page.inner_text("table.fields")
        assert "gnirts" in fields and "<script>alert(1)</script>" in fields
        assert await page.locator("script, img, iframe, textarea").count() == 0
        # The text's own </table> closed nothing: the page's tables are whole.
        assert await page.locator("h2:has-text('History') + table tbody tr").count() == 2
        assert dialogs == []

    await chromium.run(scenario)


def _get(address: tuple[str, int], target: bytes) -> tuple[int, bytes]:
    """The status and body of ``GET target``, sent as these bytes."""
    with socket.create_connection(address, timeout=30) as s:
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: ui\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_requests_that_are_not_utf8_get_a_clear_answer(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    [web] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")
    host, port = web.removeprefix("http://").rsplit(":", 1)
    address = (host, int(port))
    # Percent-encoded bytes that are not UTF-8 (or NUL) reach the pages
    # as replacement characters: a page says what it could not use.
    for target, status, says in (
        (b"/machine/%FF%FE", 400, "not a machine id (UUID): '\ufffd\ufffd'"),
        (b"/machines?state=%FF", 400, "unknown state '\ufffd'"),
        (b"/machines?after=%00", 400, "not a machine id (UUID): '\\x00'"),
        (b"/nowhere/%C3%28", 404, "No page at /nowhere/\ufffd(."),
    ):
        got, body = await trio.to_thread.run_sync(_get, address, target)
        assert got == status, target
        document = body.decode("utf-8")
        _inert(document, says)
        assert '<a href="/machines">Machines</a>' in document
    # Raw bytes that are not ASCII in the request line: refused by the HTTP
    # layer before any page runs.
    for target in (b"/machine/\xff\xfe", b"/machines?state=\xff"):
        got, _ = await trio.to_thread.run_sync(_get, address, target)
        assert got == 400, target
    # And the server goes on serving.
    got, body = await trio.to_thread.run_sync(_get, address, b"/machines")
    assert got == 200 and b"</html>" in body
