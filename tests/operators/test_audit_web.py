"""The operators' actions on the web UI, in Chromium: the audit page and a
machine's hold and actions, read-only (no form, no button, no POST)."""

from __future__ import annotations

import httpx
import trio
from playwright.async_api import BrowserContext

import bmdb
from bmdb.actions import act
from bmdb.model import ProviderStatus, Queries
from console.server import serve
from tests.bmdb.helpers import add_provided_machines
from tests.operators.browser import Chromium

#: A reason an operator might paste: shown as text, never as markup.
HTML_REASON = "swap <b>disk</b> & <script>alert(1)</script>"


async def test_audit_page_and_machine_actions_in_chromium(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery, chromium: Chromium
) -> None:
    held, gone = await add_provided_machines(bmdb_conn, 2)
    await act(bmdb_conn, "hold", held, operator="alice", reason="firmware")
    await act(bmdb_conn, "release", held, operator="bob", reason="firmware done")
    await act(bmdb_conn, "hold", held, operator="carol", reason=HTML_REASON)

    async def missing(q: Queries) -> None:
        await q.update_provided(gone, None, None, ProviderStatus.MISSING)

    await bmdb_conn.transact(missing)
    await act(bmdb_conn, "forget-machine", gone, operator="dave", reason="device deleted")
    urls: list[str] = await nursery.start(serve, bmdb_conn, "127.0.0.1:0")
    web = urls[0]

    async def scenario(context: BrowserContext) -> None:
        page = await context.new_page()
        dialogs: list[str] = []
        page.on("dialog", lambda d: dialogs.append(d.message))
        await page.goto(f"{web}/machines")
        await page.get_by_role("link", name="Audit", exact=True).click()
        await page.wait_for_url("**/audit")
        assert await page.title() == "Audit log - BMDB"
        rows: list[list[str]] = await page.eval_on_selector_all(
            "main > table tbody tr",
            "rows => rows.map(r => Array.from(r.cells, c => c.innerText))",
        )
        # Newest first: who, what, on which machine, why, what changed.
        assert [(r[2], r[3], r[4], r[5]) for r in rows] == [
            ("dave", "forget-machine", str(gone), "device deleted"),
            ("carol", "hold", str(held), HTML_REASON),
            ("bob", "release", str(held), "firmware done"),
            ("alice", "hold", str(held), "firmware"),
        ]
        assert rows[0][6].startswith("deleted the machine (Static:static-1")
        assert rows[2][6].startswith("released the hold of alice")
        # The forgotten machine's records stay listed; its page is gone.
        await page.get_by_role("link", name=str(held)).first.click()
        await page.wait_for_url(f"**/machine/{held}")
        section = await page.inner_text("h2:has-text('Operator actions') ~ p")
        assert "Held by carol since" in section and HTML_REASON in section
        actions = await page.inner_text("h2:has-text('Operator actions (3)') ~ table")
        assert [line.split("\t")[3] for line in actions.splitlines()[1:]] == [
            "hold", "release", "hold"
        ]  # fmt: skip
        # Read-only: nothing to click that acts, and nothing the reason said ran.
        for url in (f"{web}/audit", f"{web}/machine/{held}"):
            await page.goto(url)
            assert await page.locator("form, button, input, script").count() == 0
            assert await page.locator("main b").count() == 0
        assert dialogs == []
        await page.goto(f"{web}/audit?machine={gone}")
        assert await page.locator("main > table tbody tr").count() == 1
        response = await page.goto(f"{web}/machine/{gone}")
        assert response is not None and response.status == 404

    await chromium.run(scenario)
    async with httpx.AsyncClient(base_url=web) as client:
        assert (await client.post("/audit")).status_code == 405
        assert (await client.get("/audit?before=x")).status_code == 400
        assert (await client.get("/audit?machine=nope")).status_code == 400
