"""The web UI in a real browser (Debian's chromium, driven by Playwright)."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import uuid

import httpx
import pytest
import trio
from playwright.async_api import Browser, BrowserContext, Page
from prometheus_client.parser import text_string_to_metric_families

import bmdb
from bmdb import overview
from bmdb.overview import State
from console.server import serve
from tests.operators.browser import Chromium
from tests.operators.populate import HTML_CAUSE, HTML_PROVIDER_ID, Fleet, populate


@pytest.fixture
async def fleet(bmdb_conn: bmdb.Connection) -> Fleet:
    return await populate(bmdb_conn)


@pytest.fixture
async def web(bmdb_conn: bmdb.Connection, nursery: trio.Nursery) -> str:
    """The UI's base URL, served until the test ends."""
    urls: list[str] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")
    return urls[0]


async def _rows(page: Page) -> list[list[str]]:
    cells: list[list[str]] = await page.eval_on_selector_all(
        "main > table tbody tr",
        "rows => rows.map(r => Array.from(r.cells, c => c.innerText))",
    )
    return cells


async def test_filter_to_failed_and_follow_a_machine(
    fleet: Fleet, web: str, chromium: Chromium
) -> None:
    failed = fleet.ids[State.FAILED]

    async def scenario(context: BrowserContext) -> None:
        page = await context.new_page()
        await page.goto(f"{web}/machines")
        assert len(await _rows(page)) == 7
        # Our own markup is markup: none of its tags shows up as text (the
        # machine with HTML in its texts does show those, as it should).
        assert not re.search(r"</?(p|br|a|span|svg|table|tr|td)\b", await page.inner_text("body"))
        await page.get_by_role("link", name="failed (2)").click()
        await page.wait_for_url("**/machines?state=failed")
        rows = await _rows(page)
        assert sorted(r[0] for r in rows) == sorted([str(failed), str(fleet.html_machine)])
        assert {r[1] for r in rows} == {"failed"}
        await page.get_by_role("link", name=str(failed)).click()
        await page.wait_for_url(f"**/machine/{failed}")
        assert await page.title() == f"Machine {failed} - BMDB"
        assert "<" not in await page.inner_text("body")
        tags = await page.inner_text("table.fields")
        assert "last failure cause\tno route to host" in tags
        backoff = await page.inner_text("h2:has-text('Backoff') + table")
        assert "ShepherdAgentStart" in backoff and "no route to host" in backoff
        assert "3600s" in backoff
        history = await page.inner_text("h2:has-text('History') + table")
        lines = history.splitlines()[1:]
        assert [line.split("\t")[2] for line in lines] == ["Started", "Failed"]
        assert lines[1].endswith("no route to host")

    await chromium.run(scenario)


async def test_html_in_the_database_is_shown_as_text(
    fleet: Fleet, web: str, chromium: Chromium
) -> None:
    async def scenario(context: BrowserContext) -> None:
        page = await context.new_page()
        dialogs: list[str] = []
        page.on("dialog", lambda d: dialogs.append(d.message))
        await page.goto(f"{web}/machines?state=failed")
        row = next(r for r in await _rows(page) if r[0] == str(fleet.html_machine))
        assert row[5] == HTML_PROVIDER_ID
        assert row[-1] == HTML_CAUSE  # the cause is the last column
        await page.goto(f"{web}/machine/{fleet.html_machine}")
        tags = await page.inner_text("table.fields")
        assert HTML_PROVIDER_ID in tags and HTML_CAUSE in tags
        # Nothing the database said became an element.
        assert await page.locator("script").count() == 0
        assert await page.locator("img").count() == 0
        assert await page.locator("b").count() == 0
        assert dialogs == []
        # An id that is HTML: a 400 page that shows it as text.
        response = await page.goto(f"{web}/machine/%3Cb%3Ehi%3C%2Fb%3E")
        assert response is not None and response.status == 400
        assert "<b>hi</b>" in await page.inner_text("main")
        assert await page.locator("main b").count() == 0

    await chromium.run(scenario)


async def test_pages_answer_ten_browsers_at_once(
    fleet: Fleet, web: str, chromium: Chromium
) -> None:
    async def one(browser: Browser, n: int) -> int:
        # A context each: ten users, each with its own cookies and connections.
        context = await browser.new_context()
        page = await context.new_page()
        loads = 0
        for _ in range(3):
            await page.goto(f"{web}/machines")
            assert len(await _rows(page)) == 7
            mid = list(fleet.ids.values())[n % len(fleet.ids)]
            await page.get_by_role("link", name=str(mid)).click()
            await page.wait_for_url(f"**/machine/{mid}")
            assert str(mid) in await page.title()
            response = await page.goto(f"{web}/sessions")
            assert response is not None and response.status == 200
            loads += 3
        await context.close()
        return loads

    async def scenario(context: BrowserContext) -> list[int]:
        browser = context.browser
        assert browser is not None
        return list(await asyncio.gather(*(one(browser, n) for n in range(10))))

    assert await chromium.run(scenario) == [9] * 10


async def test_paging_and_errors(bmdb_conn: bmdb.Connection, fleet: Fleet, web: str) -> None:
    async with httpx.AsyncClient(base_url=web) as client:
        ids: list[str] = []
        url = "/machines?limit=3"
        while url:
            r = await client.get(url)
            assert r.status_code == 200
            assert r.headers["server-timing"].startswith("app;dur=")
            ids += [line.split('href="/machine/')[1][:36] for line in r.text.split("<tr>")[2:]]
            nxt = r.text.split('rel="next" id="next"')[0].rsplit('<a href="', 1)
            url = nxt[1].split('"')[0].replace("&amp;", "&") if 'id="next"' in r.text else ""
        listed = await overview.machines(bmdb_conn)
        assert [uuid.UUID(i) for i in ids] == [m.machine_id for m in listed]
        assert (await client.get("/machines?state=bogus")).status_code == 400
        assert (await client.get(f"/machine/{uuid.uuid4()}")).status_code == 404
        assert (await client.get("/nowhere")).status_code == 404
        assert (await client.post("/machines")).status_code == 405


async def test_console_web_command_serves_until_sigterm(fleet: Fleet, bmdb_url: str) -> None:
    argv = [
        sys.executable, "-m", "console", "--url", bmdb_url, "web", "--listen", "127.0.0.1:0",
        "--metrics-listen", "127.0.0.1:0",
    ]  # fmt: skip
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        text = b""
        with trio.fail_after(60):
            while text.count(b"\n") < 2:
                text += await proc.stdout.receive_some(1)
        metrics_line, serving_line = text.decode().splitlines()
        assert metrics_line.startswith("metrics on http://127.0.0.1:"), metrics_line
        assert serving_line.startswith("serving on http://127.0.0.1:"), serving_line
        base = serving_line.split()[2]
        async with httpx.AsyncClient(base_url=base) as client:
            r = await client.get("/machines?state=silent")
            assert r.status_code == 200 and str(fleet.ids[State.SILENT]) in r.text
            # Started without the cluster owner's files: the link says how.
            r = await client.get("/cluster")
            assert r.status_code == 200 and "--cluster-owner-root DIR" in r.text
            scrape = await client.get(metrics_line.split()[2])
        assert scrape.status_code == 200
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(scrape.text)
            for s in family.samples
            if not s.labels or s.labels.get("connection") == "bmdb-web"
        }
        # The fleet query runs once before serving starts; the page was one
        # committed transaction of this connection.
        assert samples["bmdb_fleet_machines"] == 7
        assert samples["bmdb_transactions_executed_total"] >= 2
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_bmdb_web_says_where_the_web_ui_went(bmdb_url: str) -> None:
    """The old command, with the flags it took, prints one line and exits 2."""
    for args in (["web"], ["web", "--listen", "127.0.0.1:0", "--cluster-owner-root", "d"]):
        result = await trio.run_process(
            [sys.executable, "-m", "bmdb", "--url", bmdb_url, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert (result.returncode, result.stdout) == (2, b"")
        [line] = result.stderr.decode().splitlines()
        assert "python -m console web" in line


async def test_console_web_wants_both_owner_files(bmdb_url: str) -> None:
    argv = [sys.executable, "-m", "console", "--url", bmdb_url, "web", "--cluster-owner-root", "d"]
    result = await trio.run_process(argv, capture_stderr=True, check=False)
    assert result.returncode == 2
    assert "--cluster-owner-root and --cluster-owner-key go together" in result.stderr.decode()
